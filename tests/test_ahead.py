"""Proposals drafted ahead (app/speculation/ahead.py, DraftsAhead): which one fits a round's context, consumed
once; the shifted form for flexible requests only; a branch adopted where the main one misses; and
nothing left running once a request ends. The round loop's use of them: tests/test_scheduler.py."""

import asyncio

import torch

from app.speculation.ahead import DraftsAhead
from app.speculation.steps import Proposal


def proposal(tokens: list[int], guess: int | None = None) -> Proposal:
    n = len(tokens)
    return Proposal(list(tokens), torch.tensor(tokens).view(n, 1), torch.ones(n, 1), {"steps": n}, guess=guess)


class Draft:
    """A draft that proposes `context[-1] + 1, + 2, ...` (k tokens), and records what it was asked."""

    def __init__(self, hold: bool = False):
        self.asked: list[tuple[list[int], int, str | None]] = []
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def __call__(self, context: list[int], k: int, seq_id: str | None) -> Proposal:
        self.asked.append((list(context), k, seq_id))
        await self.release.wait()
        return proposal([context[-1] + i for i in range(1, k + 1)])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_the_main_proposal_fits_its_own_context_once_and_only_when_in_hand():
    async def go():
        draft = Draft(hold=True)
        drafts = DraftsAhead(draft)
        drafts.ask_main([1, 2, 3], 2)
        await asyncio.sleep(0)
        assert drafts.ready([1, 2, 3], flexible=True) is None  # still drafting: not in hand
        draft.release.set()
        await asyncio.sleep(0.01)
        assert drafts.ready([1, 2, 4], flexible=True) is None  # another context: no
        got = drafts.ready([1, 2, 3], flexible=True)
        assert got.tokens == [4, 5] and "hidden_s" in got.stats
        assert drafts.main is None and drafts.ready([1, 2, 3], flexible=True) is None  # consumed
        assert draft.asked == [([1, 2, 3], 2, None)]
    run(go())


def test_the_shifted_form_serves_flexible_requests_only_and_only_when_its_first_token_was_kept():
    async def go():
        drafts = DraftsAhead(Draft())
        drafts.ask_main([1, 2, 3], 3)  # proposes 4, 5, 6
        await asyncio.sleep(0.01)
        assert drafts.shifted([1, 2, 3, 9]) and not drafts.shifted([1, 2, 4, 9])  # asked for this context less its last
        assert drafts.ready([1, 2, 3, 4], flexible=False) is None  # a seeded request's K is its own: never shifted
        assert drafts.ready([1, 2, 3, 9], flexible=True) is None  # the target kept another token
        got = drafts.ready([1, 2, 3, 4], flexible=True)
        assert got.tokens == [5, 6]
    run(go())


def test_a_branch_for_the_rounds_context_is_adopted_and_the_others_dropped():
    async def go():
        draft = Draft(hold=True)
        drafts = DraftsAhead(draft)
        drafts.ask_main([1, 2, 3, 4, 5], 2)  # the likely outcome: everything accepted
        drafts.branches = [drafts.ask([1, 2, 3, 7], 2, "r#1"), drafts.ask([1, 2, 3, 8], 2, "r#2")]
        main, (first, second) = drafts.main, drafts.branches
        drafts.adopt_branch([1, 2, 3, 8])  # the round ended in the second rejection
        await asyncio.sleep(0)
        assert drafts.main is second and drafts.branches == []
        assert main.task.cancelled() and first.task.cancelled() and not second.task.done()
        draft.release.set()
        assert (await drafts.wait_main()).tokens == [9, 10]
    run(go())


def test_a_fitting_main_proposal_keeps_its_place_over_the_branches():
    async def go():
        drafts = DraftsAhead(Draft(hold=True))
        drafts.ask_main([1, 2], 2)
        drafts.branches = [drafts.ask([1, 2], 2, "r#1")]
        main, branch = drafts.main, drafts.branches[0]
        drafts.adopt_branch([1, 2])
        await asyncio.sleep(0)
        assert drafts.main is main and branch.task.cancelled() and drafts.branches == []
        drafts.close()
    run(go())


def test_closing_cancels_every_proposal_still_drafting():
    async def go():
        drafts = DraftsAhead(Draft(hold=True))
        drafts.ask_main([1], 2)
        drafts.branches = [drafts.ask([2], 2, "r#1")]
        tasks = [drafts.main.task, drafts.branches[0].task]
        drafts.close()
        await asyncio.sleep(0)
        assert all(t.cancelled() for t in tasks) and drafts.main is None and drafts.branches == []
    run(go())
