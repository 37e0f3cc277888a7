"""Proposals drafted ahead: asked for a context a sequence may reach next round, while this round
verifies (app/driver.py, Rounds). Which one a round uses changes only when its proposal is in hand,
never a token."""

import asyncio
from dataclasses import dataclass

from app.spec import Proposal


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
