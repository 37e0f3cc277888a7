"""The text a real target's draft learns from: the target's own answers, with its top-k distribution
at every generated position.

Two kinds of prompt, as the pair is served:
- chat: user turns the target writes itself. Given its chat template up to an open user turn (and,
  for most, a few opening words from `OPENERS`), the instruct model samples a plausible request;
  then it answers that request through the template, greedy for most, sampled for some. With no
  dataset to download, the model's own requests are the widest supply of chat prompts there is.
- code: the heads of functions from the standard library's training modules, continued as raw
  text (a completion, no template).

Everything is generated in batches with `generate`, and saved in shards so that a long build can
stop and go on where it was.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

# Opening words of a user turn: the target writes the rest. They steer the requests towards what a
# served pair is asked (code, explanations, lists, rewriting, maths) without writing any request whole.
OPENERS = (
    "", "", "", "", "Write a Python function", "Write a Python", "Write a function", "How do I", "How can I",
    "Explain", "What is", "What are", "Can you", "Give me", "List", "Write a short", "Summarize", "Why does",
    "Describe", "Help me", "I need", "Create a", "Write code", "Implement", "Fix this", "Compare",
    "What's the difference between", "Tell me", "Write an email", "Suggest", "Translate", "Calculate",
)


@dataclass(frozen=True)
class TextPlan:
    """How much teacher text to generate, and its shape."""

    chat_share: float = 0.7       # the rest is code completions
    sampled_share: float = 0.25   # chat answers sampled (temperature below) instead of greedy
    temperature: float = 0.7
    query_tokens: int = 48        # the longest self-written user turn
    answer_tokens: int = 128
    code_prompt_chars: int = 360
    code_tokens: int = 128
    batch: int = 96               # sequences per generate call: a decode step costs far less than its batch
    top_k: int = 32               # the target's most likely tokens kept per position


@dataclass
class Shard:
    """One batch of teacher text: prompt + generated ids, where the loss applies, and the target's
    top-k at every position (what the draft learns to match)."""

    tokens: torch.Tensor    # [N, L] int32, right-padded with pad_id
    loss_mask: torch.Tensor  # [N, L - 1] bool: position t predicts token t + 1, a generated one
    top_ids: torch.Tensor   # [N, L - 1, k] int32 (zeros where loss_mask is False)
    top_logp: torch.Tensor  # [N, L - 1, k] float16


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


# Rows per `generate` call on a CPU. A GPU takes a whole shard at once; a CPU keeps every step's
# logits of 1024 rows (26 GB in float32 over 128 steps) in no memory it has.
CPU_ROWS = 96


def _generate(model, prompts: list[list[int]], new_tokens: int, eos: int, pad: int, temperature: float,
              gen: torch.Generator | None, top_k: int
              ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Continue each prompt, in calls of as many rows as the device holds; returns each row's generated
    ids (up to and with its eos) and the target's top-k log-probabilities at each generated position."""
    rows = len(prompts) if model.device.type == "cuda" else CPU_ROWS
    parts = [_generate_rows(model, prompts[i: i + rows], new_tokens, eos, pad, temperature, gen, top_k)
             for i in range(0, len(prompts), rows)]
    return tuple([x for part in parts for x in part[j]] for j in range(3))


@torch.no_grad()
def _generate_rows(model, prompts: list[list[int]], new_tokens: int, eos: int, pad: int, temperature: float,
                   gen: torch.Generator | None, top_k: int
                   ) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """One `generate` call over prompts, left-padded."""
    ids, mask = (t.to(model.device) for t in _left_pad(prompts, pad))
    sample = temperature > 0
    if sample:  # generate draws from torch's global generator: seed it from ours
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=sample,
                         temperature=temperature if sample else None, top_p=None, top_k=None,
                         eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
                         cache_implementation="static")  # a static cache: no copy of the whole cache per step
    new = out.sequences[:, ids.shape[1]:].cpu()  # [B, T]
    tops = [F.log_softmax(step.float(), dim=-1).topk(top_k, dim=-1) for step in out.logits]  # raw, untempered
    top_logp = torch.stack([t.values for t in tops], dim=1).cpu()  # [B, T, k]
    top_ids = torch.stack([t.indices for t in tops], dim=1).cpu()
    rows, tops_i, tops_l = [], [], []
    for b in range(new.shape[0]):
        row = new[b].tolist()
        n = row.index(eos) + 1 if eos in row else len(row)
        rows.append(row[:n])
        tops_i.append(top_ids[b, :n])
        tops_l.append(top_logp[b, :n])
    return rows, tops_i, tops_l


def _shard(prompts: list[list[int]], answers: list[list[int]], tops_i: list[torch.Tensor],
           tops_l: list[torch.Tensor], pad: int, k: int) -> Shard:
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    n = len(prompts)
    tokens = torch.full((n, width), pad, dtype=torch.int32)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    top_ids = torch.zeros((n, width - 1, k), dtype=torch.int32)
    top_logp = torch.zeros((n, width - 1, k), dtype=torch.float16)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        tokens[i, : len(p) + len(a)] = torch.tensor(p + a, dtype=torch.int32)
        s = slice(len(p) - 1, len(p) - 1 + len(a))  # position t's logits predict token t + 1
        loss_mask[i, s] = True
        top_ids[i, s] = tops_i[i].to(torch.int32)
        top_logp[i, s] = tops_l[i].to(torch.float16)
    return Shard(tokens, loss_mask, top_ids, top_logp)


def chat_shard(model, tok, plan: TextPlan, rng: random.Random, gen: torch.Generator) -> Shard:
    """A batch of self-written user turns and the target's answers to them."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    head = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                   add_generation_prompt=False).split("\x00")[0]  # up to the open user turn
    openers = [rng.choice(OPENERS) for _ in range(plan.batch)]
    starts = [tok(head + o, add_special_tokens=False).input_ids for o in openers]
    queries, _, _ = _generate(model, starts, plan.query_tokens, eos, pad, 1.0, gen, 1)
    texts = [o + tok.decode(q, skip_special_tokens=True) for o, q in zip(openers, queries)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t.strip()}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    temperature = plan.temperature if rng.random() < plan.sampled_share else 0.0
    answers, ti, tl = _generate(model, prompts, plan.answer_tokens, eos, pad, temperature, gen, plan.top_k)
    return _shard(prompts, answers, ti, tl, pad, plan.top_k)


def code_prompts(n: int, max_chars: int, rng: random.Random) -> list[str]:
    """Function heads from the standard library's training modules (never the held-out ones)."""
    import ast

    from specserve.demo.corpus import read_source, training_files

    files, out = training_files(), []
    while len(out) < n:
        source = read_source(rng.choice(files))
        try:
            fns = [f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)]
        except SyntaxError:
            continue
        if not fns:
            continue
        fn = rng.choice(fns)
        lines = source.splitlines(keepends=True)[fn.lineno - 1: fn.end_lineno]
        take = rng.randint(2, max(2, len(lines) - 1))  # cut at a line end, somewhere in the function
        head = "".join(lines[:take])[-max_chars:]
        if head.count("\n") >= 2:
            out.append(head[head.index("\n") + 1:] if len(head) == max_chars else head)
    return out


def code_shard(model, tok, plan: TextPlan, rng: random.Random, gen: torch.Generator) -> Shard:
    """A batch of standard-library function heads and the target's greedy continuations."""
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    heads = code_prompts(plan.batch, plan.code_prompt_chars, rng)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in heads]
    answers, ti, tl = _generate(model, prompts, plan.code_tokens, eos, pad, 0.0, gen, plan.top_k)
    return _shard(prompts, answers, ti, tl, pad, plan.top_k)


def generate_shards(model, tok, out: Path, shards: int, plan: TextPlan, seed: int,
                    tick: Callable[[int], None] = lambda tokens: None) -> list[Path]:
    """Shards 0..shards-1 of teacher text under out/ (those already there are kept: a build resumes)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = out / f"shard-{i:04d}.pt"
        paths.append(path)
        if path.exists():
            tick(0)
            continue
        rng, gen = random.Random(seed * 100_003 + i), torch.Generator().manual_seed(seed * 100_003 + i)
        kind = chat_shard if rng.random() < plan.chat_share else code_shard
        shard = kind(model, tok, plan, rng, gen)
        tmp = path.with_suffix(".tmp")
        torch.save(shard.__dict__, tmp)
        tmp.rename(path)
        tick(int(shard.loss_mask.sum()))
    return paths


def load_shard(path: Path) -> Shard:
    return Shard(**torch.load(path))
