"""The per-request loop of rounds, shared by the in-process engine and the Serve router.

The driver owns the request's state; `propose` and `verify` are injected async callables (local
micro-batchers in process, deployment handles in Serve), so the same loop runs in both places.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from app.controller import CostEstimator, KController
from app.request import RequestState
from app.spec import Proposal, ProposeItem, Verdict, VerifyItem


class DraftUnavailable(Exception):
    """The draft could not answer in time: the round falls back to a plain target step."""


ProposeFn = Callable[[ProposeItem], Awaitable[Proposal]]
VerifyFn = Callable[[VerifyItem], Awaitable[Verdict]]


def within_room(state: RequestState, k: int) -> int:
    """K capped by the room left: a round emits at most K + 1 tokens and feeds K more positions."""
    return max(0, min(k, state.room() - 1))


def _costs(state: RequestState, costs: CostEstimator, verify_cost: Callable[[], float]) -> tuple[float, float]:
    """(c, verify cost) the controller weighs for this request.

    A seeded sampled request must give the same output wherever it runs, and its draws depend on
    the K of each round, so its K may depend only on its own acceptance history: it sees the prior
    c and no load. Greedy output does not depend on K, so greedy requests use the live figures.
    """
    if state.params.seed is not None and not state.params.greedy:
        return costs.config.prior_c, 0.0
    return costs.c, verify_cost()


async def run_rounds(
    state: RequestState,
    propose: ProposeFn | None,
    verify: VerifyFn,
    controller: KController,
    costs: CostEstimator,
    verify_cost: Callable[[], float] = lambda: 0.0,
) -> AsyncIterator[list[int]]:
    """Drive rounds until the request stops; yields the tokens each round kept."""
    while not state.finished:
        wanted = controller.choose(*_costs(state, costs, verify_cost)) if propose else 0
        k = within_room(state, wanted)
        proposal, fallback, t_draft = Proposal.empty(), False, 0.0
        if k > 0:
            t0 = time.perf_counter()
            try:
                proposal = await propose(ProposeItem(state.request_id, state.token_ids, k, state.params, state.seed))
            except DraftUnavailable:
                fallback = True
            t_draft = time.perf_counter() - t0
        elif wanted == 0 and propose and state.params.speculation.pinned_k() != 0:
            fallback = True  # speculation is on, but the controller found it would not pay
        t0 = time.perf_counter()
        verdict = await verify(VerifyItem(state.request_id, state.token_ids, proposal, state.params, state.seed))
        t_verify = time.perf_counter() - t0
        if proposal.tokens:
            costs.observe(t_draft, len(proposal.tokens), t_verify)
            controller.observe(len(proposal.tokens), verdict.accepted)
        state.stats.record(verdict.drafted, verdict.accepted, len(verdict.tokens), fallback,
                           verdict.stats.get("batch_size", 1))
        yield state.append(verdict.tokens)
