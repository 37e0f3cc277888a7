"""Proposals drafted ahead: asked for a context a sequence may reach next round, while this round
verifies (app/speculation/driver.py, Rounds). Which one a round uses changes only when its proposal is in hand,
never a token."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.speculation.steps import Proposal


@dataclass
class Ahead:
    """A proposal requested for a context the sequence may reach next round."""

    context: list[int]
    task: asyncio.Task
    started: float
    finished: float | None = None  # when the draft answered (set by the task's done callback)
    prompt: bool = False  # asked beside the prompt's prefill (not drafting ahead: its use is no "ahead hit")


def hidden(proposal: Proposal, ahead: Ahead, waited: float) -> Proposal:
    """The proposal with the part of the draft's round trip that ran while earlier rounds verified
    (up to when it answered: time it then sat in hand is not draft time)."""
    hidden_s = max(0.0, min(waited, ahead.finished if ahead.finished is not None else waited) - ahead.started)
    return Proposal(proposal.tokens, proposal.q_ids, proposal.q_probs, {**proposal.stats, "hidden_s": hidden_s},
                    proposal.guess, proposal.runner_ups)


def cancel(task: asyncio.Task) -> None:
    """Stop a proposal no round will use; its cancellation or failure is no error."""
    task.cancel()
    task.add_done_callback(_consume)


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class DraftsAhead:
    """One sequence's proposals drafted ahead: the one for the round's likely outcome (all accepted,
    bonus = the draft's guess; or the prompt's, asked beside its prefill) and the branches for its
    likeliest rejections. Rounds (app/speculation/driver.py) decides what to ask for; this holds what was asked,
    finds what fits a round's context, and drops the rest."""

    def __init__(self, draft: Callable[[list[int], int, str | None], Awaitable[Proposal]]):
        self.draft = draft  # (context, k, draft-side id or None) -> the proposal
        self.main: Ahead | None = None
        self.branches: list[Ahead] = []

    def ask(self, context: list[int], k: int, seq_id: str | None = None) -> Ahead:
        """Start drafting k tokens for `context`; the request is returned, not kept."""
        a = Ahead(context, asyncio.ensure_future(self.draft(context, k, seq_id)), time.perf_counter())
        a.task.add_done_callback(lambda _: setattr(a, "finished", time.perf_counter()))
        return a

    def ask_main(self, context: list[int], k: int) -> None:
        self.main = self.ask(context, k)

    def shifted(self, context: list[int]) -> bool:
        """Whether the main proposal was asked for this context less its last token."""
        a = self.main
        return a is not None and len(context) == len(a.context) + 1 and context[:-1] == a.context

    def adopt_branch(self, context: list[int]) -> None:
        """At a round's start: the branch drafted for exactly this context (if any) becomes the main
        proposal, unless the main one fits; every other branch is dropped."""
        a = self.main
        fits = a is not None and (a.context == context or self.shifted(context))
        match = None if fits else next((b for b in self.branches if b.context == context), None)
        for b in self.branches:
            if b is not match:
                cancel(b.task)
        self.branches = []
        if match is not None:
            self.cancel_main()
            self.main = match

    def ready(self, context: list[int], flexible: bool) -> Proposal | None:
        """The main proposal, if it is in hand and fits this round's context; consumed.

        It fits when it was drafted for exactly this context, or (flexible requests) for this context
        less its last token and the draft's first token is that token. Its first min(k, K ahead) tokens
        are then used: a seeded sampled request's K depends on its own history only, so there the two
        are equal, and it never takes the shifted form, which is one token shorter; greedy output does
        not depend on K, and an unseeded request's distribution does not either.
        """
        a = self.main
        if a is None or not a.task.done() or a.task.cancelled() or a.task.exception() is not None:
            return None
        proposal = a.task.result()
        if a.context != context:
            proposal = proposal.after(context[-1]) if flexible and self.shifted(context) else None
            if proposal is None:
                return None
        self.main = None
        return hidden(proposal, a, time.perf_counter())

    async def wait_main(self) -> Proposal:
        """Wait for the main proposal (in flight); consumed."""
        a, self.main = self.main, None
        waited = time.perf_counter()
        return hidden(await a.task, a, waited)

    def cancel_main(self) -> None:
        if self.main is not None:
            cancel(self.main.task)
            self.main = None

    def close(self) -> None:
        """The request ended: drop every proposal still being drafted for it."""
        self.cancel_main()
        for b in self.branches:
            cancel(b.task)
        self.branches = []
