"""How long a proposal is when the draft is unsure (ProposeItem.stop_below).

A draft token the draft itself gives a low probability is one the target will likely refuse, and so
is every token after it (acceptance stops at the first refusal). A row's proposal therefore ends
with the first token whose top draft probability at its position is below the row's bound: fewer
draft steps and fewer verify rows for the tokens that would have been refused (the dynamic draft
length of EAGLE-2 and its peers). app/speculation/drafting.py's propose() keeps one `Lengths` per batch.

Exact: a proposal's length depends on the draft's distribution alone, never on the target's.
"""

from __future__ import annotations

import torch

from app.model.syncs import to_device


class Lengths:
    """Each row's proposal length under its `stop_below`: up to and including the first token the draft
    gives less than that probability (its top probability at the position: greedy rows over the
    draft's logits, sampled rows over the q they sample from), at most k. Kept on the device and read
    once with the tokens; on a CPU (where a read costs nothing) the steps stop when every row has
    what it needs: its tokens and its guess, the draft's next token."""

    def __init__(self, items: list, device: torch.device):  # items: the batch's ProposeItems
        self.bounds = to_device(torch.tensor([it.stop_below for it in items], dtype=torch.float32), device)
        self.greedy = to_device(torch.tensor([it.sampling.greedy for it in items]), device)
        self.items, self.host = items, device.type == "cpu"
        self.confident_steps: list[torch.Tensor] = []  # [B] bool per step
        self.guess_steps: list[torch.Tensor] = []  # [B] per step: the guess were the proposal to end there
        self.known: list[int | None] = [None] * len(items)  # rows' lengths, as the CPU reads them

    def step(self, logits: torch.Tensor, q_probs: torch.Tensor, guesses: torch.Tensor | None) -> None:
        """One draft step: its (processed) logits [B, V], the q [B, M] each row sampled from, and the
        guess [B] each sampled row gives were its proposal to end here (None when all are greedy: a
        greedy row's guess is its next drafted token)."""
        top = torch.where(self.greedy, logits.softmax(-1).amax(-1), q_probs.amax(-1))
        self.confident_steps.append(top >= self.bounds)
        self.guess_steps.append(guesses)

    def done(self, step: int) -> bool:
        """On a CPU: whether every row has its tokens and its guess once token `step` is drafted (one read
        of this step's confidence); elsewhere never (the steps run to k, with no read between them)."""
        if not self.host:
            return False
        confident = self.confident_steps[-1].tolist()
        for i, it in enumerate(self.items):
            if self.known[i] is None and (step + 1 >= it.k or not confident[i]):
                self.known[i] = step + 1
        return all(n is not None and n + it.guess <= step + 1 for n, it in zip(self.known, self.items))

    def confident(self) -> torch.Tensor:
        return torch.stack(self.confident_steps, 1).long()

    def guesses(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, steps]: the guess a row gives were its proposal to end before each step."""
        if all(g is None for g in self.guess_steps):
            return tokens
        drawn = torch.stack(self.guess_steps, 1)
        return torch.where(self.greedy.unsqueeze(1), tokens, drawn)

    @staticmethod
    def length(item: object, confident: list[int]) -> int:
        """A row's proposal length from its per-step confidence."""
        for step, ok in enumerate(confident[: item.k]):
            if not ok:
                return step + 1
        return item.k
