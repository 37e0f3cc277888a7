"""Logit rules that depend on what came before a position: bias, min_tokens and the penalties.

Speculation stays exact whatever distribution p the target's logits are turned into, as long as p
at position j is a function of the tokens before j (app/speculation/sampling.py). These rules are such
functions: a verify round applies them at each of its K+1 positions with exactly the tokens
before it, the draft tokens accepted up to there included, and the draft applies the same rules
along its own proposal, so its q is processed alike and acceptance stays high.

The order is vLLM's: logit bias and min_tokens, then the repetition, frequency and presence
penalties; temperature, min_p, top-k and top-p follow in app.speculation.sampling.process_logits. Frequency
and presence count output tokens only; repetition counts prompt and output (as vLLM and HF do).

Written here rather than taken from transformers' logits processors: those take one [B, T] batch
of histories that grow a token per step, while a verify round needs K+1 histories per sequence,
each one draft token longer than the last, computed from one count and a prefix sum.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.grammar import grammar_of
from app.params import SamplingParams


@dataclass(frozen=True)
class LogitRules:
    """One request's history-dependent rules; `of` returns None when they would change nothing."""

    prompt_len: int  # tokens of the context that are prompt (the rest is output)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # what min_tokens holds back: the request's eos and stop ids
    grammar: str | None = None  # the output's grammar (app/grammar.py), applied by the model's server

    @classmethod
    def of(cls, params: SamplingParams, prompt_len: int, stop_ids: frozenset[int]) -> "LogitRules | None":
        rules = cls(prompt_len, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                    tuple(sorted(params.logit_bias.items())), params.min_tokens,
                    tuple(sorted(stop_ids)) if params.min_tokens else (), grammar_of(params.response_format))
        active = (rules.presence or rules.frequency or rules.repetition != 1.0 or rules.bias
                  or (rules.min_tokens and rules.stop_ids) or rules.grammar)
        return rules if active else None

    def apply(self, logits: torch.Tensor, history: Sequence[int], new: Sequence[int] = ()) -> torch.Tensor:
        """logits [N, V] of N consecutive positions: row j follows history + new[:j] (N <= len(new) + 1).
        Returns new float32 logits; the input is left as it is."""
        n, v = logits.shape
        device = logits.device
        out = logits.float().clone()
        if self.bias:
            ids = torch.tensor([t for t, _ in self.bias if t < v], dtype=torch.long, device=device)
            values = torch.tensor([b for t, b in self.bias if t < v], device=device)
            out[:, ids] += values
        if self.min_tokens and self.stop_ids:
            produced = len(history) - self.prompt_len + torch.arange(n, device=device)
            stops = torch.tensor([t for t in self.stop_ids if t < v], dtype=torch.long, device=device)
            early = (produced < self.min_tokens).unsqueeze(-1)
            out[:, stops] = torch.where(early, float("-inf"), out[:, stops])
        if self.presence or self.frequency or self.repetition != 1.0:
            counts = self._output_counts(history, new[: n - 1], n, v, device)
            if self.repetition != 1.0:
                prompt = torch.zeros(v, dtype=torch.bool, device=device)
                prompt[torch.tensor(list(history[: self.prompt_len]), dtype=torch.long, device=device)] = True
                seen = (counts > 0) | prompt
                out = torch.where(seen, torch.where(out > 0, out / self.repetition, out * self.repetition), out)
            out = out - self.frequency * counts - self.presence * (counts > 0).float()
        return out

    def _output_counts(self, history: Sequence[int], new: Sequence[int], n: int, v: int,
                       device: torch.device) -> torch.Tensor:
        """[N, V] float32: row j counts each token in the output part of history + new[:j]."""
        output = torch.tensor(list(history[self.prompt_len:]), dtype=torch.long, device=device)
        base = torch.bincount(output, minlength=v)[:v].float()
        if not len(new):
            return base.expand(n, v)
        steps = torch.zeros(n, v, device=device)
        rows = torch.arange(1, len(new) + 1, device=device)
        steps[rows, torch.tensor(list(new), dtype=torch.long, device=device)] = 1.0
        return base + steps.cumsum(0)
