"""Training the demo pair: a byte-level BPE tokenizer, a target trained on the corpus, and a draft
distilled from the target's logits so that their greedy choices agree as often as possible.

Both models are plain `LlamaForCausalLM`s. Training runs in bfloat16 autocast (CPUs with
AVX512-BF16/AMX do bf16 matmuls several times faster than fp32) with fp32 master weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"


@dataclass(frozen=True)
class ModelShape:
    """The size of one Llama model."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    tied: bool = False  # share the embedding with the LM head: saves vocab x hidden params

    def config(self, vocab_size: int, max_positions: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads, max_position_embeddings=max_positions,
            tie_word_embeddings=self.tied, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides what a build produces (with the seed)."""

    vocab_size: int
    seq_len: int
    tokenizer_chars: int  # BPE learns merges from this much training text: plenty, and fast
    target: ModelShape    # wide and deep enough that its decode step dwarfs the draft's
    draft: ModelShape     # one layer: its step is mostly fixed per-forward overhead
    target_steps: int
    draft_steps: int
    batch: int
    target_lr: float
    draft_lr: float
    # Sequence-level distillation: the draft also learns on the target's own greedy
    # continuations of corpus prefixes, which is exactly the text greedy speculation verifies.
    kd_sequences: int = 0   # how many greedy sequences to generate (0: corpus windows only)
    kd_prompt_len: int = 64  # corpus prefix length of each sequence
    kd_new_tokens: int = 64  # greedy tokens generated after it
    kd_share: float = 0.5   # fraction of each distillation batch taken from those sequences


PLANS = {
    # Many small updates beat few large ones at this compute: 300 steps of 8 x 256 tokens.
    # The draft then spends half of each batch on the target's own greedy text (512 corpus
    # prefixes of 128 tokens, 96 greedy tokens each: held-out prompts are about that long).
    "full": BuildPlan(
        vocab_size=4096, seq_len=256, tokenizer_chars=3_000_000,
        target=ModelShape(layers=8, hidden=512, intermediate=1536, heads=8),
        draft=ModelShape(layers=1, hidden=256, intermediate=768, heads=4, tied=True),
        target_steps=300, draft_steps=500, batch=8, target_lr=3e-3, draft_lr=3e-3,
        kd_sequences=512, kd_prompt_len=128, kd_new_tokens=96, kd_share=0.5,
    ),
    # Seconds to build; for tests of the build and load path, not for measuring speculation.
    "quick": BuildPlan(
        vocab_size=1024, seq_len=128, tokenizer_chars=400_000,
        target=ModelShape(layers=2, hidden=256, intermediate=512, heads=4),
        draft=ModelShape(layers=1, hidden=64, intermediate=128, heads=2, tied=True),
        target_steps=30, draft_steps=30, batch=8, target_lr=3e-3, draft_lr=3e-3,
        kd_sequences=8, kd_prompt_len=32, kd_new_tokens=16, kd_share=0.5,
    ),
}


def train_tokenizer(texts: list[str], plan: BuildPlan) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) that prepends BOS, wrapped for `from_pretrained`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=plan.vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_first_chars(texts, plan.tokenizer_chars), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )


def _first_chars(texts: list[str], n: int) -> list[str]:
    out, total = [], 0
    for t in texts:
        if total >= n:
            break
        out.append(t[: n - total])
        total += len(out[-1])
    return out


def encode_corpus(tok: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All documents as one token stream, each as BOS text EOS. Returns [N] int64."""
    encodings = tok.backend_tokenizer.encode_batch(texts)  # BOS is added by the post-processor
    eos = tok.eos_token_id
    return torch.tensor([t for e in encodings for t in (*e.ids, eos)], dtype=torch.long)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of the stream. Returns [batch, seq_len + 1] (inputs and shifted labels)."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def _optimizer(model: torch.nn.Module, lr: float, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = max(1, steps // 20)
    # Linear warm-up, then cosine decay to 10% of lr.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    return opt, sched


def _step(model: torch.nn.Module, loss: torch.Tensor, opt, sched) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


Tick = Callable[[float], None]  # called after each step with its loss


def train_target(model: LlamaForCausalLM, stream: torch.Tensor, plan: BuildPlan,
                 gen: torch.Generator, tick: Tick) -> None:
    """Next-token cross-entropy on random windows of the corpus."""
    opt, sched = _optimizer(model, plan.target_lr, plan.target_steps)
    model.train()
    for _ in range(plan.target_steps):
        x = sample_batch(stream, plan.batch, plan.seq_len, gen)  # [B, T+1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        _step(model, loss, opt, sched)
        tick(loss.item())
    model.eval()


GEN_BATCH = 32  # greedy sequences generated together


@torch.no_grad()
def greedy_sequences(target: LlamaForCausalLM, stream: torch.Tensor, plan: BuildPlan,
                     gen: torch.Generator, tick: Callable[[], None]) -> torch.Tensor:
    """The target's greedy continuations of random corpus prefixes, batched with a KV cache.
    Returns [kd_sequences, kd_prompt_len + kd_new_tokens] (prefix then continuation)."""
    out_seqs = []
    for start in range(0, plan.kd_sequences, GEN_BATCH):
        n = min(GEN_BATCH, plan.kd_sequences - start)
        x = sample_batch(stream, n, plan.kd_prompt_len - 1, gen)  # [n, P]
        out = target(x, use_cache=True)
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]  # [n, 1] each
        for _ in range(plan.kd_new_tokens - 1):
            out = target(toks[-1], past_key_values=out.past_key_values, use_cache=True)
            toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
        out_seqs.append(torch.cat([x, *toks], dim=1))
        tick()
    return torch.cat(out_seqs)


def distill_draft(draft: LlamaForCausalLM, target: LlamaForCausalLM, stream: torch.Tensor,
                  plan: BuildPlan, gen: torch.Generator, tick: Tick,
                  sequences: torch.Tensor | None = None) -> None:
    """KL(target || draft) on every position: the draft learns the target's whole distribution,
    so its argmax follows the target's, which is what greedy acceptance rewards. Part of each
    batch (plan.kd_share) comes from `sequences`, the target's own greedy text, so the draft
    learns most where speculation is verified; the rest from corpus windows of the same length."""
    opt, sched = _optimizer(draft, plan.draft_lr, plan.draft_steps)
    draft.train()
    n_seq = 0 if sequences is None else round(plan.batch * plan.kd_share)
    length = plan.seq_len if sequences is None else sequences.shape[1]
    for _ in range(plan.draft_steps):
        parts = []
        if n_seq:
            parts.append(sequences[torch.randint(0, sequences.shape[0], (n_seq,), generator=gen)])
        if plan.batch > n_seq:
            parts.append(sample_batch(stream, plan.batch - n_seq, length, gen)[:, :-1])
        x = torch.cat(parts)  # [B, T]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            p_log = F.log_softmax(target(x).logits.float(), dim=-1)  # [B, T, V]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q_logits = draft(x).logits
        q_log = F.log_softmax(q_logits.float(), dim=-1)
        loss = F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")
        _step(draft, loss, opt, sched)
        tick(loss.item())
    draft.eval()


def new_model(shape: ModelShape, plan: BuildPlan) -> LlamaForCausalLM:
    """A freshly initialised model (seed torch first for reproducibility)."""
    return LlamaForCausalLM(shape.config(plan.vocab_size, max_positions=4096))
