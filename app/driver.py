"""The per-request loop of rounds, shared by the in-process engine and the Serve router.

The driver owns the request's state; `propose` and `verify` are injected async callables (local
micro-batchers in process, deployment handles in Serve), so the same loop runs in both places.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from app import telemetry
from app.controller import CostEstimator, KController
from app.request import RequestState
from app.spec import Proposal, ProposeItem, Verdict, VerifyItem
from app.telemetry import NoObserver, RoundFacts, RoundObserver


class DraftUnavailable(Exception):
    """The draft could not answer: the round falls back to a plain target step.

    `reason` says why, for metrics and traces: "draft_unavailable" (an error, or backing off after
    one) or "deadline" (the draft was slower than its timeout).
    """

    def __init__(self, message: str = "", reason: str = "draft_unavailable"):
        super().__init__(message)
        self.reason = reason


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
    observer: RoundObserver = NoObserver(),
    trace_parent: telemetry.Parent = None,
) -> AsyncIterator[list[int]]:
    """Drive rounds until the request stops; yields the tokens each round kept.

    Each round is a span (child of `trace_parent`) and is reported to `observer`.
    """
    while not state.finished:
        # the span ends before the yield: a span must not stay current while the caller runs
        with telemetry.span("round", trace_parent) as span:
            verdict, facts = await _round(state, propose, verify, controller, costs, verify_cost)
            telemetry.set_attributes(span, telemetry.round_attributes(facts))
        observer.round(facts)
        state.stats.record(verdict.drafted, verdict.accepted, len(verdict.tokens), facts.fallback is not None,
                           facts.batch_size)
        yield state.append(verdict.tokens)


async def _round(state: RequestState, propose: ProposeFn | None, verify: VerifyFn, controller: KController,
                 costs: CostEstimator, verify_cost: Callable[[], float]) -> tuple[Verdict, RoundFacts]:
    """One round: choose K, propose (failing open), verify, feed the controller."""
    t_round = time.perf_counter()
    wanted = controller.choose(*_costs(state, costs, verify_cost)) if propose else 0
    k = within_room(state, wanted)
    proposal, fallback, t_draft = Proposal.empty(), None, 0.0
    if k > 0:
        t0 = time.perf_counter()
        try:
            with telemetry.span("draft.propose", attributes={"specserve.k": k}):
                proposal = await propose(ProposeItem(state.request_id, state.token_ids, k, state.params, state.seed,
                                                     trace=telemetry.carrier()))
        except DraftUnavailable as e:
            fallback = e.reason
        t_draft = time.perf_counter() - t0
    elif wanted == 0 and propose and state.params.speculation.pinned_k() != 0:
        fallback = "controller"  # speculation is on, but the controller found it would not pay
    t0 = time.perf_counter()
    with telemetry.span("target.verify", attributes={"specserve.k": len(proposal.tokens)}):
        verdict = await verify(VerifyItem(state.request_id, state.token_ids, proposal, state.params, state.seed,
                                          trace=telemetry.carrier()))
    t_verify = time.perf_counter() - t0
    if proposal.tokens:
        costs.observe(t_draft, len(proposal.tokens), t_verify)
        controller.observe(len(proposal.tokens), verdict.accepted)
    return verdict, RoundFacts(
        k=k, drafted=verdict.drafted, accepted=verdict.accepted, emitted=len(verdict.tokens), fallback=fallback,
        round_s=time.perf_counter() - t_round, draft_s=t_draft, verify_s=t_verify,
        draft_forward_s=proposal.stats.get("forward_s", 0.0), verify_forward_s=verdict.stats.get("forward_s", 0.0),
        batch_size=verdict.stats.get("batch_size", 1))
