"""Training the demo pair: a byte-level BPE tokenizer, a target trained on the corpus, and a draft
distilled from the target's logits so that their greedy choices agree as often as possible.

Both models are plain `LlamaForCausalLM`s. Training runs in bfloat16 autocast with fp32 master
weights where the CPU does bf16 matmuls natively (AVX512-BF16/AMX, ARM BF16), in float32 elsewhere
(`app.model.dtypes`): the recipe is the same, the rounding differs. The target learns with AdamW. The draft's hidden weight matrices learn with Muon
(orthogonalised momentum), its embeddings and norms with AdamW: in one-off trials, 250 such
steps on the target's greedy text gave held-out τ 3.58 at K = 4, AdamW alone 3.36. (Muon also
took the target to a lower held-out loss in a third of the steps, 5.57 against 5.70, but that
target's greedy text fell into loops, 10 % distinct 4-grams against 29 %: a pair that speculates
on loops is a weaker pair, whatever its τ.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.model.hf_compat import returned_cache, with_cache
from specserve.demo.muon import Muon

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
    batch: int          # target training sequences per step
    draft_batch: int    # draft distillation sequences per step
    target_lr: float
    draft_lr: float     # AdamW's (embeddings, norms); the draft's hidden matrices take MUON_LR
    # The draft learns on the target's own greedy continuations of corpus prefixes, which is
    # exactly the text greedy speculation verifies, against the target's top-k distribution at
    # every position, recorded while that text was generated (no teacher forward per step).
    kd_sequences: int = 64   # how many greedy sequences to generate
    kd_prompt_len: int = 64  # corpus prefix length of each sequence
    kd_new_tokens: int = 64  # greedy tokens generated after it
    teacher_top_k: int = 32  # the target's most likely tokens kept per position
    # how much of the corpus is encoded for training (None: all of it); encoding the whole standard
    # library is most of a quick build (9 of 12 s preparing, on 2 cores) whose steps read 30k tokens
    corpus_chars: int | None = None


PLANS = {
    # Sized to build in about 2.5 minutes on 2 cores without native bf16 (float32, AVX2). At this
    # compute, updates count more than tokens or width: 500 steps of 2 x 256 tokens for a 6-layer,
    # 256-wide target beat 130 steps of 8 x 256 for an 8-layer one (held-out loss 6.08 against
    # 6.35, 34 % distinct greedy 4-grams against 9 %); wider, or a higher learning rate, did worse.
    # The draft then learns from the target's greedy text: 256 corpus prefixes of 128 tokens,
    # 96 greedy tokens each (held-out prompts are about that long).
    "full": BuildPlan(
        vocab_size=4096, seq_len=256, tokenizer_chars=3_000_000,
        target=ModelShape(layers=6, hidden=256, intermediate=768, heads=4),
        draft=ModelShape(layers=1, hidden=256, intermediate=768, heads=4, tied=True),
        target_steps=500, draft_steps=200, batch=2, draft_batch=8, target_lr=3e-3, draft_lr=3e-3,
        kd_sequences=256, kd_prompt_len=128, kd_new_tokens=96,
    ),
    # Seconds to build; for tests of the build and load path, not for measuring speculation.
    "quick": BuildPlan(
        vocab_size=1024, seq_len=128, tokenizer_chars=400_000,
        target=ModelShape(layers=2, hidden=256, intermediate=512, heads=4),
        draft=ModelShape(layers=1, hidden=64, intermediate=128, heads=2, tied=True),
        target_steps=30, draft_steps=30, batch=8, draft_batch=8, target_lr=3e-3, draft_lr=3e-3,
        kd_sequences=8, kd_prompt_len=32, kd_new_tokens=16, teacher_top_k=8, corpus_chars=1_000_000,
    ),
}
MUON_LR = 0.04  # Muon's step for the draft's hidden matrices ("original" scaling)


def train_tokenizer(texts: list[str], plan: BuildPlan) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style, newlines apart) that prepends BOS, wrapped for `from_pretrained`."""
    tok = Tokenizer(models.BPE())
    # A newline is a token of its own, never merged with the indentation after it: a prompt cut at a
    # line end (as code prompts are) then ends on a token the models saw before every line, not on a
    # bare newline they saw only before column-0 text (which sent greedy text into blank-line loops).
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=plan.vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(first_chars(texts, plan.tokenizer_chars), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )


def first_chars(texts: list[str], n: int | None) -> list[str]:
    """The texts, in order, cut after n characters in all (None: all of them)."""
    if n is None:
        return texts
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


class _Optimizer:
    """AdamW, or (muon=True) Muon for the decoder's weight matrices and AdamW for the rest; one
    schedule: linear warm-up, then cosine decay to 10 %."""

    def __init__(self, model: torch.nn.Module, lr: float, steps: int, muon: bool = False, bf16: bool = False):
        def hidden(name: str, p: torch.Tensor) -> bool:  # Muon is for hidden matrices only
            return muon and p.ndim == 2 and "embed" not in name and "lm_head" not in name
        named = list(model.named_parameters())
        self.opts = [torch.optim.AdamW([p for n, p in named if not hidden(n, p)], lr=lr, betas=(0.9, 0.95),
                                       weight_decay=0.05)]
        if muon:
            self.opts.append(Muon([p for n, p in named if hidden(n, p)], lr=MUON_LR,
                                  dtype=torch.bfloat16 if bf16 else torch.float32))
        warmup = max(1, steps // 20)
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
            for o in self.opts]
        self.model = model

    def step(self, loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for o, s in zip(self.opts, self.scheds):
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)


Tick = Callable[[float], None]  # called after each step with its loss


def autocast(bf16: bool, device_type: str = "cpu"):
    """bf16 autocast where the device does bf16 natively (fp32 master weights), else a no-op: fp32."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)


def train_target(model: LlamaForCausalLM, stream: torch.Tensor, plan: BuildPlan,
                 gen: torch.Generator, tick: Tick, bf16: bool) -> None:
    """Next-token cross-entropy on random windows of the corpus."""
    opt = _Optimizer(model, plan.target_lr, plan.target_steps)
    model.train()
    for _ in range(plan.target_steps):
        x = sample_batch(stream, plan.batch, plan.seq_len, gen)  # [B, T+1]
        with autocast(bf16):
            logits = model(x[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.step(loss)
        tick(loss.item())
    model.eval()


GEN_BATCH = 128  # greedy sequences generated together: a decode step's cost grows far slower than its batch


@dataclass
class GreedyText:
    """The target's greedy continuations of corpus prefixes and, at every position but the last,
    the target's top-k next-token distribution there (what the draft learns to match)."""

    tokens: torch.Tensor     # [N, L] int64: prefix then continuation
    top_ids: torch.Tensor    # [N, L - 1, k] int64
    top_logp: torch.Tensor   # [N, L - 1, k] float32, the target's log-probabilities of top_ids


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ids = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, logp


@torch.no_grad()
def greedy_sequences(target: LlamaForCausalLM, stream: torch.Tensor, plan: BuildPlan,
                     gen: torch.Generator, tick: Callable[[], None]) -> GreedyText:
    """The target's greedy continuations of random corpus prefixes, batched with a KV cache:
    kd_sequences of kd_prompt_len + kd_new_tokens tokens, with the target's top-k at each position."""
    tokens, top_ids, top_logp = [], [], []
    for start in range(0, plan.kd_sequences, GEN_BATCH):
        n = min(GEN_BATCH, plan.kd_sequences - start)
        x = sample_batch(stream, n, plan.kd_prompt_len - 1, gen)  # [n, P]
        out = target(x, use_cache=True)
        tops = [_top(out.logits, plan.teacher_top_k)]
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]  # [n, 1] each
        for _ in range(plan.kd_new_tokens - 1):
            out = target(toks[-1], use_cache=True, **with_cache(target, returned_cache(out)))
            tops.append(_top(out.logits, plan.teacher_top_k))
            toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
        tokens.append(torch.cat([x, *toks], dim=1))
        top_ids.append(torch.cat([i for i, _ in tops], dim=1))
        top_logp.append(torch.cat([lp for _, lp in tops], dim=1))
        tick()
    return GreedyText(torch.cat(tokens), torch.cat(top_ids), torch.cat(top_logp))


def distill_draft(draft: LlamaForCausalLM, text: GreedyText, plan: BuildPlan, gen: torch.Generator,
                  tick: Tick, bf16: bool) -> None:
    """Cross-entropy of the draft against the target's top-k distribution (renormalised) at every
    position of the target's greedy text: the draft learns the target's distribution where
    speculation is verified, so its argmax follows the target's, which is what acceptance rewards."""
    opt = _Optimizer(draft, plan.draft_lr, plan.draft_steps, muon=True, bf16=bf16)
    draft.train()
    for _ in range(plan.draft_steps):
        rows = torch.randint(0, text.tokens.shape[0], (plan.draft_batch,), generator=gen)
        with autocast(bf16):
            q_logits = draft(text.tokens[rows, :-1]).logits  # [B, L - 1, V]
        q_logp = F.log_softmax(q_logits.float(), dim=-1).gather(-1, text.top_ids[rows])
        loss = -(torch.softmax(text.top_logp[rows], dim=-1) * q_logp).sum(-1).mean()
        opt.step(loss)
        tick(loss.item())
    draft.eval()


def new_model(shape: ModelShape, plan: BuildPlan) -> LlamaForCausalLM:
    """A freshly initialised model (seed torch first for reproducibility)."""
    return LlamaForCausalLM(shape.config(plan.vocab_size, max_positions=4096))
