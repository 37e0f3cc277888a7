"""A draft for a real target, distilled from the target's own text (`demo.teacher_text`).

The draft is a plain `LlamaForCausalLM` that shares the target's tokenizer, narrow and shallow so
that its step costs a small share of the target's: on CPU (and on a GPU at batch 1) a step of a
small model is its tied head, a vocab x hidden matrix, plus a fixed cost per layer. Its embedding
(and so its head) starts as the target's embedding projected onto its top principal directions,
so it begins with the target's geometry of tokens instead of noise.

It learns by cross-entropy against the target's top-k distribution (renormalised) at every
generated position of the teacher text, computed only there: its argmax then follows the target's,
which is what greedy acceptance rewards, and its whole distribution the target's, which is what
sampled acceptance (sum of min(p, q)) rewards.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from app.speculation.draft_vocab import RANKING
from specserve.demo.teacher_text import TextPlan, load_shard
from specserve.demo.train import _Optimizer, autocast


@dataclass(frozen=True)
class DraftShape:
    """The draft's size. Width sets the head's cost, depth the per-layer cost."""

    layers: int = 4
    hidden: int = 256
    intermediate: int = 1024
    heads: int = 4
    kv_heads: int = 4


@dataclass(frozen=True)
class DistillPlan:
    shape: DraftShape = DraftShape()
    epochs: float = 6.0      # on 0.6M tokens held-out acceptance rose to the end of 6 (docs/demo-pair.md)
    batch: int = 16          # sequences per step
    lr: float = 2e-3         # AdamW's (embedding, norms); hidden matrices take Muon's
    seed: int = 0


def new_draft(target: PreTrainedModel, shape: DraftShape) -> LlamaForCausalLM:
    """A draft with the target's vocabulary, special ids and rotary settings, its tied embedding the
    target's projected onto its `hidden` principal directions (scaled to the target's spread)."""
    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=getattr(tc, "rope_parameters", None), rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
    )
    draft = LlamaForCausalLM(config)
    emb = target.get_input_embeddings().weight.detach().float().cpu()  # [V, H_target]
    centred = emb - emb.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred[torch.randperm(emb.shape[0])[:16384]], full_matrices=False)
    projected = centred @ v[: shape.hidden].T  # [V, hidden]
    projected *= emb.std() / projected.std()
    draft.get_input_embeddings().weight.data.copy_(projected)
    return draft


def _batches(paths: list[Path], batch: int, rng: random.Random):
    """Rows of the shards in a random order, `batch` at a time, padded to their longest."""
    shards = [load_shard(p) for p in paths]
    rows = [(s, i) for s in shards for i in range(s.tokens.shape[0])]
    rng.shuffle(rows)
    for start in range(0, len(rows) - batch + 1, batch):
        chunk = rows[start: start + batch]
        width = max(int(s.loss_mask[i].nonzero().max()) + 2 for s, i in chunk)

        def stack(field: str, w: int) -> torch.Tensor:  # each row cut or zero-padded to w positions
            parts = [getattr(s, field)[i, :w] for s, i in chunk]
            return torch.stack([F.pad(p, (0, 0) * (p.ndim - 1) + (0, w - p.shape[0])) for p in parts])

        yield (stack("tokens", width).long(),          # [B, W]
               stack("loss_mask", width - 1),          # [B, W-1]
               stack("top_ids", width - 1).long(),     # [B, W-1, k]
               stack("top_logp", width - 1).float())   # [B, W-1, k]


def distill_loss(draft: LlamaForCausalLM, tokens, mask, top_ids, top_logp, bf16: bool) -> torch.Tensor:
    """Cross-entropy against the target's renormalised top-k, at the masked positions only (the head
    over 49k tokens is most of the cost, so it runs where the loss is)."""
    with autocast(bf16, draft.device.type):
        hidden = draft.model(input_ids=tokens[:, :-1]).last_hidden_state  # [B, W-1, H]
        logits = draft.lm_head(hidden[mask])  # [N, V]
    q_logp = F.log_softmax(logits.float(), dim=-1).gather(-1, top_ids[mask])  # [N, k]
    return -(torch.softmax(top_logp[mask], dim=-1) * q_logp).sum(-1).mean()


def distill(draft: LlamaForCausalLM, paths: list[Path], plan: DistillPlan, bf16: bool,
            tick: Callable[[float], None] = lambda loss: None) -> None:
    """Train the draft on the shards for plan.epochs passes."""
    rows = sum(load_shard(p).tokens.shape[0] for p in paths)
    steps = int(plan.epochs * (rows // plan.batch))
    opt = _Optimizer(draft, plan.lr, steps, muon=True, bf16=bf16)
    rng, done = random.Random(plan.seed), 0
    draft.train()
    for _ in range(math.ceil(plan.epochs)):
        for batch in _batches(paths, plan.batch, rng):
            if done == steps:
                break
            loss = distill_loss(draft, *(t.to(draft.device, non_blocking=True) for t in batch), bf16=bf16)
            opt.step(loss)
            done += 1
            tick(loss.item())
    draft.eval()


@dataclass(frozen=True)
class DraftRecipe:
    """The whole recipe: how much teacher text, and how the draft learns from it."""

    shards: int = 36             # of TextPlan.batch sequences each: 36864 sequences, 4.19M generated tokens
    text: TextPlan = TextPlan(batch=1024)
    plan: DistillPlan = DistillPlan(epochs=2.74, batch=64)


RECIPE = DraftRecipe()


def copy_tokenizer(target: Path, out: Path) -> None:
    """The target's tokenizer files into a draft's directory: the pair shares one tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (target / name).exists():
            shutil.copy2(target / name, out / name)





def token_ranking(draft: PreTrainedModel, sequences: Iterable[list[int]], window: int = 512,
                  batch: int = 16) -> list[int]:
    """Every token id of the draft's vocabulary, the ones it proposes most first: counted where the
    draft's argmax lands over `sequences` (teacher text, in windows of `window` tokens, `batch` at a
    time), then by how often the text itself shows a token, then in id order (a BPE vocabulary's ids
    follow its merges, the most common first). Ranked by its own argmax the draft keeps what it would
    propose: over 650k positions of teacher text and standard-library code the reference draft's
    argmax took 8710 distinct tokens, and its 16384 (8192) most proposed ones kept all but 1.5 %
    (2.4 %) of its greedy matches with the target on the held-out prompts; ranked by the text's
    counts, 1.5 % (4.2 %); by id, 4.8 % (10.8 %)."""
    vocab = draft.get_output_embeddings().out_features
    device = next(draft.parameters()).device
    proposed = torch.zeros(vocab, dtype=torch.int64, device=device)
    shown = torch.zeros(vocab, dtype=torch.int64, device=device)
    windows = [ids[i: i + window] for ids in sequences for i in range(0, len(ids), window)]
    with torch.inference_mode():
        for b in range(0, len(windows), batch):
            rows = windows[b: b + batch]
            ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            real = torch.zeros(ids.shape, dtype=torch.bool)
            for r, w in enumerate(rows):  # right-padded: a causal model's real positions never see the padding
                ids[r, : len(w)], real[r, : len(w)] = torch.tensor(w), True
            ids, real = ids.to(device), real.to(device)
            argmax = draft(ids, attention_mask=real.long()).logits.argmax(-1)
            proposed += torch.bincount(argmax[real], minlength=vocab)
            shown += torch.bincount(ids[real & (ids < vocab)], minlength=vocab)
    # one stable sort per key, the least significant first: id order is where they start
    order = torch.sort(-shown, stable=True).indices
    return order[torch.sort(-proposed[order], stable=True).indices].tolist()


def write_ranking(out: Path, draft: PreTrainedModel, sequences: list[list[int]], how: str) -> None:
    """The draft's token ranking (`token_ranking`) beside its weights, with how it was made."""
    ranking = token_ranking(draft, sequences)
    record = {"how": how, "tokens": sum(len(s) for s in sequences), "ranking": ranking}
    (out / RANKING).write_text(json.dumps(record))


def teacher_sequences(paths: list[Path]) -> list[list[int]]:
    """Each teacher sequence's tokens (prompt and answer), without its padding."""
    out = []
    for path in paths:
        shard = load_shard(path)
        for row, mask in zip(shard.tokens, shard.loss_mask):
            generated = mask.nonzero()
            end = int(generated[-1]) + 2 if len(generated) else row.shape[0]  # through the last generated token
            out.append(row[:end].tolist())
    return out


def build_draft(target_dir: Path, out: Path, work: Path, recipe: DraftRecipe = RECIPE,
                observe: Callable[[LlamaForCausalLM, int, float], None] | None = None,
                device: str = "cpu") -> dict:
    """Generate the teacher text (resumable, under work/), distill a draft from it, save it to out/
    in bfloat16 with the target's tokenizer and a record of the recipe. Returns the record.
    `observe(draft, step, loss)` after each step: a trial's checkpoints and held-out figures.
    On a GPU (`device="cuda"`) the same recipe runs in minutes instead of hours; the text and the
    draft differ from a CPU build's only by the devices' arithmetic."""
    from dataclasses import asdict

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.model import dtypes
    from specserve.demo.teacher_text import generate_shards

    bf16 = dtypes.native_bf16(device)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtypes.compute_dtype(device)).to(device).eval()
    bar = tqdm(total=recipe.shards, desc="smollm2 draft: teacher text", unit="shard", dynamic_ncols=True)
    tokens = [0]

    def shard_done(n: int) -> None:
        tokens[0] += n
        bar.update(1)
        bar.set_postfix(tokens=tokens[0])

    paths = generate_shards(target, tok, work, recipe.shards, recipe.text, recipe.plan.seed, shard_done)
    bar.close()
    t_text = time.time()
    torch.manual_seed(recipe.plan.seed)
    del target  # the generating copy (bf16 where native); the draft starts from the float32 embedding
    draft = new_draft(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32), recipe.plan.shape)
    draft = draft.to(device)
    shards = [load_shard(p) for p in paths]
    tokens[0] = sum(int(s.loss_mask.sum()) for s in shards)  # all of them, resumed ones included
    steps = int(recipe.plan.epochs * (sum(s.tokens.shape[0] for s in shards) // recipe.plan.batch))
    del shards
    bar = tqdm(total=steps, desc="smollm2 draft: distilling", unit="step", dynamic_ncols=True)

    def step_done(loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if observe:
            observe(draft, bar.n, loss)

    distill(draft, paths, recipe.plan, bf16, step_done)
    bar.close()
    out.mkdir(parents=True, exist_ok=True)
    write_ranking(out, draft.eval(), teacher_sequences(paths), "specserve.demo.distill.build_draft: the recipe's teacher text")
    draft.to("cpu", torch.bfloat16).save_pretrained(out)
    copy_tokenizer(target_dir, out)
    record = {"recipe": asdict(recipe), "teacher_tokens": tokens[0], "compute_dtype": "bfloat16" if bf16 else "float32",
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else
              f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)",
              "seconds": {"teacher_text": round(t_text - t0), "distill": round(time.time() - t_text)}}
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    return record
