"""One request's rounds, top to bottom: choose K, propose, verify, keep; the draft runs a round ahead.

The same loop runs in process (app.engine) and in every TargetServer replica (deployments.servers):
`propose` and `verify` are injected async callables. In process both are local forward queues; in
a replica verify is the replica's own forward queue and propose a call to the draft pool. Each
queue runs one forward at a time over every sequence waiting, so the rounds of all the requests a
replica holds are batched continuously: a request joins the next forward the moment its round is
ready, and a prompt is a round with K = 0 whose new tokens are the whole prompt.

Draft ahead (pre-speculation): while round n is verified, the draft is already asked for round
n+1 under the likely outcome that all K tokens are accepted and the target's bonus token is the
draft's own guess of it. If so, round n+1 starts with its proposal in hand. A proposal is a
function of the context alone (its draws are addressed by position), so using it changes timing,
never tokens.

Never wait with company: a greedy or unseeded request whose next proposal is not in hand while
other sequences share its target does not wait for the draft (its rounds would drift out of step
with theirs). It runs this round as a plain target step in the same forward; when the target's token
is the draft's first, the rest of that proposal is next round's. Alone on its target, it waits. A
seeded sampled request always waits: its draws depend on each round's K, which must not depend on load.

First token at once: a request's first round (no output yet) is a plain target step, the prompt's
prefill, as it is with speculation off; the draft is asked beside it, never before it, for the
prompt's proposal. When the target's first token is the draft's first, the rest of that proposal is
the second round's (for requests whose output does not depend on K); either way the draft holds
the prompt's KV by then. Every request's first round has K = 0 whatever the load, so seeded output
stays a function of the request alone; a resumed request (it has output) skips the rule.

Fail open, per sequence: a draft that errs or misses its deadline turns this sequence's rounds
into plain target steps for a while. A seeded sampled request first asks again (its output depends
on its K; a retry gets the same proposal from any replica): a killed draft replica changes nothing.
"""

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from app import telemetry
from app.model.blocks import PREFIX_BLOCK
from app.speculation.ahead import DraftsAhead
from app.speculation.draft_policy import DraftPolicy, DraftUnavailable
from app.speculation.controller import CostEstimator, KController, VerifyCost
from app.request import RequestState
from app.speculation.steps import BRANCH_SLOTS, RUNNER_UP_POSITIONS, Proposal, ProposeItem, Verdict, VerifyItem, branch_id
from app.telemetry import NoObserver, RoundFacts, RoundObserver

ProposeFn = Callable[[ProposeItem], Awaitable[Proposal]]
VerifyFn = Callable[[VerifyItem], Awaitable[Verdict]]


def within_room(state: RequestState, k: int, emitted: int = 0) -> int:
    """K capped by the room left after `emitted` more tokens: a round emits at most K + 1 tokens."""
    return max(0, min(k, state.room() - emitted - 1))


def _costs(state: RequestState, costs: CostEstimator,
           verify_cost: Callable[[], float]) -> tuple[float, float, float]:
    """(c, verify cost, fixed draft overhead) the controller weighs for this request.

    A seeded sampled request must give the same output wherever it runs, and its draws depend on
    the K of each round, so its K may depend only on its own acceptance history: it sees the prior
    c and no load. Greedy output does not depend on K, so greedy requests use the live figures.
    """
    if state.params.seed is not None and not state.params.greedy:
        return costs.config.prior_c, 0.0, 0.0
    return costs.c, verify_cost(), costs.overhead


@dataclass
class RoundContext:
    """What a request's rounds run on, beside the request: the calls to the draft (None: no draft)
    and to the target, the engine's shared costs and draft policy, and what it tells of its load."""

    propose: ProposeFn | None
    verify: VerifyFn
    costs: CostEstimator
    verify_cost: Callable[[], VerifyCost] = lambda: 0.0
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    company: Callable[[], bool] = lambda: False  # whether other sequences share this one's target forwards
    load: Callable[[], int] = lambda: 1  # the engine's sequences in flight, for the goodput gate's measure
    prefill_chunk: int | None = None  # a longer context is prefilled in chunks of this many tokens
    # positions of a context the target's prefix cache holds (under a cache salt); None: not known here
    target_cached: Callable[[list[int], str | None], int] | None = None


@dataclass
class Drafted:
    """A round's proposal, and how it came: why there is none (a fallback reason), whether one
    drafted ahead served (None: none was asked ahead), the seconds spent getting it."""

    proposal: Proposal
    fallback: str | None = None
    ahead_hit: bool | None = None
    draft_s: float = 0.0


class Rounds:
    """The rounds of one request; `next()` runs one and returns what it kept and how it went."""

    def __init__(self, state: RequestState, context: RoundContext, controller: KController):
        self.state, self.propose, self.verify = state, context.propose, context.verify
        self.controller, self.costs, self.verify_cost = controller, context.costs, context.verify_cost
        self.company = context.company
        self.cached = 0  # context positions the target already holds for this sequence (as far as it knows)
        self.policy = context.policy
        self.target_cached = context.target_cached
        self.drafts = DraftsAhead(self._draft)  # proposals asked ahead: for the likely outcome and rejections
        self.draft_down_until = float("-inf")
        self.down_reason = "draft_unavailable"
        self.first = not state.output_ids  # the request's first round: the target's prefill alone
        self.draft_current = False  # whether the draft computed this sequence's last round (its proposal)

    def draft_beside_prefill(self) -> None:
        """Ask the draft for the prompt's proposal now, while the target prefills it (first round only)."""
        state = self.state
        asked = self.drafts.main is not None
        if not (self.first and self.propose and not asked) or self.policy.clock() < self.draft_down_until:
            return
        if not self.policy.beside_cached and self._prefill_cached():
            return  # the draft catches up next round, in a short forward
        k = within_room(state, self.controller.choose(*_costs(state, self.costs, self.verify_cost)), 1)
        if k > 0 and not self._gated():
            self.drafts.ask_main(list(state.token_ids), k + 1)
            self.drafts.main.prompt = True

    def _prefill_cached(self) -> bool:
        """Whether the target's prefix cache holds this context to its last block: its prefill is then a
        step of a few positions (memory-bound on a CPU, where the draft's forwards beside it slow it)."""
        if self.target_cached is None:
            return False
        ids = self.state.token_ids
        return self.target_cached(ids, self.state.params.cache_salt) >= len(ids) - PREFIX_BLOCK

    @property
    def gateable(self) -> bool:
        """Whether the engine's measured gate decides this sequence's mode (app.speculation.gate.GoodputGate): only
        where output does not depend on K (greedy or unseeded, K not pinned, a draft to ask)."""
        return (self.costs.gate is not None and self.propose is not None and self._flexible()
                and self.state.params.speculation.pinned_k() is None)

    def _flexible(self) -> bool:
        """Whether this request's output does not depend on K (greedy, or sampled without a seed)."""
        return self.state.params.greedy or self.state.params.seed is None

    def _gated(self) -> bool:
        """Whether the gate holds this sequence to plain steps now (never alone: GoodputGate)."""
        return self.gateable and self.company() and not self.costs.gate.allows()

    async def next(self) -> tuple[Verdict, RoundFacts]:
        """One round: choose K, get a proposal (drafted ahead, or now, or none), verify, learn."""
        t_round = time.perf_counter()
        if self.first:
            return await self._prompt_round(t_round)
        k, fallback = self._choose()
        self.drafts.adopt_branch(self.state.token_ids)
        got = await self._propose(k) if k > 0 and fallback is None else Drafted(Proposal.empty(), fallback)
        if got.fallback != "draft_behind":
            self.drafts.cancel_main()
        if got.proposal.tokens and self.policy.ahead and got.proposal.guess is not None:
            self._draft_ahead(got.proposal)
            self._draft_branches(got.proposal)
        return await self._verify(got.proposal, k, got.fallback, got.ahead_hit, t_round, got.draft_s)

    async def _prompt_round(self, t_round: float) -> tuple[Verdict, RoundFacts]:
        """The request's first round: the target's prefill alone, the draft asked beside it."""
        # the prefill is queued for the target's next forward before the draft is called, so the
        # call's own work (serialising the context, a hop to the draft pool) never delays it
        prefill = asyncio.ensure_future(self._verify(Proposal.empty(), 0, None, None, t_round, 0.0))
        try:
            await asyncio.sleep(0)
            if self._flexible():  # the next round takes it shifted by the target's first token; a seeded
                # request asks anew then (its K is its own), and would race this call's prefill on the draft
                with telemetry.span("draft.beside_prefill"):
                    self.draft_beside_prefill()  # asks only in the first round: `first` is cleared after it
            self.first = False
            verdict, facts = await prefill
        except BaseException:
            prefill.cancel()
            raise
        facts.prompt = True
        return verdict, facts

    def _choose(self) -> tuple[int, str | None]:
        """This round's K, and why it drafts nothing though speculation is on (None: it drafts, or
        speculation is off): the draft is down, the controller found K = 0 would pay best, or the
        gate measured plain steps faster."""
        state = self.state
        wanted = self.controller.choose(*_costs(state, self.costs, self.verify_cost)) if self.propose else 0
        gated = wanted > 0 and self._gated()
        k = within_room(state, 0 if gated else wanted)
        if k > 0 and self.policy.clock() < self.draft_down_until:
            return k, self.down_reason
        if (gated or wanted == 0) and self.propose and state.params.speculation.pinned_k() != 0:
            return k, "goodput" if gated else "controller"
        return k, None

    async def _propose(self, k: int) -> Drafted:
        """This round's proposal: drafted ahead, else awaited now; none while the draft is behind
        (for a sequence that would lose its place in the next forward) or down (fail open)."""
        state, flexible, drafts = self.state, self._flexible(), self.drafts
        t0 = time.perf_counter()
        beside_prompt = drafts.main is not None and drafts.main.prompt  # asked beside the prompt's prefill
        ready = drafts.ready(state.token_ids, flexible)
        exact = drafts.main is not None and drafts.main.context == state.token_ids
        got = Drafted(Proposal.empty(), None, exact if drafts.main is not None else None)
        try:
            if ready is not None:
                got.proposal, got.ahead_hit = ready, True
            elif flexible and self.policy.ahead and self.company() and self.costs.draft_keeps_up:
                got.fallback = "draft_behind"  # waiting would cost this sequence its place in the next forward
                got.ahead_hit = None
                if not exact:
                    got.ahead_hit = False if drafts.main is not None else None
                    drafts.cancel_main()
                    drafts.ask_main(list(state.token_ids), k + 1)
            else:
                got.proposal = await self._awaited(k, exact, flexible, got)
        except DraftUnavailable as e:
            got.fallback, self.down_reason = e.reason, e.reason
            self.draft_down_until = self.policy.clock() + self.policy.retry_after_s
            got.proposal = Proposal.empty()
        got.proposal = got.proposal.head(k)
        got.draft_s = time.perf_counter() - t0
        if beside_prompt:
            got.ahead_hit = None
        return got

    async def _awaited(self, k: int, exact: bool, flexible: bool, got: Drafted) -> Proposal:
        """A proposal awaited now: the one asked ahead for this context (or for it less its last token),
        else a new one; a seeded request's asked again after a failure."""
        context = self.state.token_ids
        try:
            if not exact and flexible and self.drafts.shifted(context):
                # drafted for this context less its last token (beside the prompt's prefill): its
                # forward is under way, so awaiting it beats queueing a new one behind it
                proposal = (await self.drafts.wait_main()).after(context[-1])
                got.ahead_hit = proposal is not None
                if proposal is not None:
                    return proposal
            elif exact:
                return await self.drafts.wait_main()
            return await self._draft(context, k)
        except DraftUnavailable:
            if flexible:
                raise
            return await self._draft_again(context, k)

    async def _verify(self, proposal: Proposal, k: int, fallback: str | None, ahead_hit: bool | None,
                      t_round: float, t_draft: float) -> tuple[Verdict, RoundFacts]:
        """Verify this round's proposal (empty: a plain target step), learn from it, report the round."""
        state = self.state
        t0 = time.perf_counter()
        with telemetry.span("target.verify", attributes={"specserve.k": len(proposal.tokens)}):
            new = len(state.token_ids) - self.cached + len(proposal.tokens)
            verdict = await self.verify(VerifyItem(state.request_id, state.token_ids, proposal, state.params,
                                                   state.seed, trace=telemetry.carrier(), new_tokens=new,
                                                   rules=state.rules))
        self.cached = len(state.token_ids) + verdict.accepted  # the last kept token is new next round
        was_current, self.draft_current = self.draft_current, bool(proposal.tokens)
        t_verify = time.perf_counter() - t0
        if proposal.tokens:
            # only where the draft saw the last round: after the prompt or plain steps a proposal holds the
            # draft's prefill of what it missed, which as steps would price the draft out for good
            if was_current:
                forward = proposal.stats.get("forward_s"), proposal.stats.get("steps")
                self.costs.observe(t_draft, len(proposal.tokens), t_verify, forward if None not in forward else None)
            self.costs.observe_acceptance(len(proposal.tokens), verdict.accepted)
            self.controller.observe(len(proposal.tokens), verdict.accepted)
        return verdict, RoundFacts(
            k=k, drafted=verdict.drafted, accepted=verdict.accepted, emitted=len(verdict.tokens), fallback=fallback,
            round_s=time.perf_counter() - t_round, draft_s=t_draft, verify_s=t_verify,
            draft_forward_s=proposal.stats.get("forward_s", 0.0), verify_forward_s=verdict.stats.get("forward_s", 0.0),
            batch_size=verdict.stats.get("batch_size", 1), ahead_hit=ahead_hit,
            draft_hidden_s=proposal.stats.get("hidden_s", 0.0))

    async def _draft(self, context: list[int], k: int, seq_id: str | None = None) -> Proposal:
        """Ask the draft for k tokens (and its guess of the bonus token, when drafting ahead; its
        runner-ups, when branching). `seq_id`: a branch's own draft-side id (default: the request's)."""
        state = self.state
        try:
            with telemetry.span("draft.propose", attributes={"specserve.k": k}):
                item = ProposeItem(seq_id or state.request_id, context, k, state.params, state.seed,
                                   trace=telemetry.carrier(), guess=self.policy.ahead, rules=state.rules,
                                   runner_ups=self.policy.branches if self._branching() else 0,
                                   stop_below=self.policy.stop_below if self._flexible() else 0.0)
                t0 = time.perf_counter()
                proposal = await asyncio.wait_for(self.propose(item), self.policy.timeout_s)
                self.costs.observe_latency(time.perf_counter() - t0)
                return proposal
        except asyncio.TimeoutError:
            raise DraftUnavailable(f"no proposal within {self.policy.timeout_s}s", "deadline") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # this request (or its drafted-ahead proposal) is being stopped
            # the draft side cancelled the call (a replica shutting down, a batch it dropped): fail open
            raise DraftUnavailable("the draft pool cancelled the proposal") from None

    async def _draft_again(self, context: list[int], k: int) -> Proposal:
        """A seeded request's proposal after a failed call: asked again with backoff (the proposal is a
        function of the context, so whichever replica answers gives the same one); the last failure
        is raised when every retry failed."""
        delay = self.policy.seeded_backoff_s
        for attempt in range(self.policy.seeded_retries):
            await asyncio.sleep(delay)
            delay *= 2
            try:
                return await self._draft(context, k)
            except DraftUnavailable:
                if attempt == self.policy.seeded_retries - 1:
                    raise
        raise DraftUnavailable("no retries allowed")

    # -- drafting ahead ----------------------------------------------------------------------
    def _draft_ahead(self, proposal: Proposal) -> None:
        """While this round verifies, draft the next one for its likely outcome: all accepted, bonus = guess."""
        state, emitted = self.state, len(proposal.tokens) + 1
        if state.room() - emitted <= 0:
            return  # the request ends with this round
        # the K the controller will choose if every token is accepted (a copy learns the outcome)
        likely = copy.deepcopy(self.controller)
        likely.observe(len(proposal.tokens), len(proposal.tokens))
        k = within_room(state, likely.choose(*_costs(state, self.costs, self.verify_cost)), emitted)
        if k <= 0 or self._gated():
            return
        self.drafts.ask_main(state.token_ids + proposal.tokens + [proposal.guess], k)

    # -- branches: drafting ahead for the likely rejections ------------------------------------
    def _branching(self) -> bool:
        """Whether this sequence drafts ahead for its likely rejections too: greedy (the target's
        correction is then its argmax, which the draft's runner-ups often guess), and alone in its
        target forwards (the draft would otherwise idle while it verifies; with company, the pool's
        time is the other sequences')."""
        return (self.policy.ahead and self.policy.branches > 0 and self.state.params.greedy
                and not self.company())

    def _draft_branches(self, proposal: Proposal) -> None:
        """While this round verifies, draft the next one for the round's likeliest rejections: the
        proposal's token j refused in favour of one of the draft's runner-ups there (j = 0, 1). Each
        is a context the round may end in; the one it does end in, if any, is used next round."""
        state = self.state
        if not (proposal.runner_ups and self._branching()):
            return
        slot = 0
        for j, alternatives in enumerate(proposal.runner_ups[:RUNNER_UP_POSITIONS]):
            likely = copy.deepcopy(self.controller)  # the K chosen after a round that accepted j
            likely.observe(len(proposal.tokens), j)
            k = within_room(state, likely.choose(*_costs(state, self.costs, self.verify_cost)), j + 1)
            for token in alternatives[: BRANCH_SLOTS - slot] if k > 0 else ():
                context = state.token_ids + proposal.tokens[:j] + [token]
                self.drafts.branches.append(self.drafts.ask(context, k, branch_id(state.request_id, slot)))
                slot += 1

    def close(self) -> None:
        """The request ended: drop any proposal still being drafted for it."""
        self.drafts.close()


async def run_rounds(state: RequestState, context: RoundContext, controller: KController,
                     observer: RoundObserver = NoObserver(), trace_parent: telemetry.Parent = None,
                     cached: int = 0) -> AsyncIterator[list[int]]:
    """Drive rounds until the request stops; yields the tokens each round kept.

    A context longer than `context.prefill_chunk` tokens is first prefilled a chunk per forward (sharing each
    forward with other sequences' rounds); the first round then computes only the last chunk. A
    request that wants its prompt's logprobs (and has streamed nothing yet) has its whole prompt
    prefilled so, each chunk scoring its tokens. `cached`: context positions the target holds for
    the sequence already (another sequence prefilled the same context: app.engine), not prefilled again.
    Each round is a span (child of `trace_parent`) and is reported to `observer`.
    """
    rounds = Rounds(state, context, controller)
    verify, prefill_chunk = context.verify, context.prefill_chunk
    rounds.cached = cached
    score = state.params.prompt_logprobs is not None and not state.output_ids
    try:
        length = len(state.token_ids)
        if prefill_chunk or score:
            step = prefill_chunk or length
            ends = [end for end in range(step, length, step) if end > cached] + ([length] if score else [])
            if ends and not state.finished:  # the draft's prefill of the prompt runs beside the target's chunks
                with telemetry.span("draft.beside_prefill", trace_parent):  # its spans join the request's trace
                    rounds.draft_beside_prefill()
            for start, end in zip([0] + ends, ends):
                with telemetry.span("prefill.chunk", trace_parent, attributes={"specserve.tokens": end}):
                    done = await verify(VerifyItem(state.request_id, state.token_ids[:end], Proposal.empty(),
                                                   state.params, state.seed, trace=telemetry.carrier(), prefill=True,
                                                   new_tokens=end - rounds.cached + (start > 0 and score),
                                                   score_from=start if score else None))
                rounds.cached = min(end, length - 1)  # a round computes at least its last context position
                state.prompt_logprobs += done.prompt_logprobs or []
                state.stats.prompt_forward_s += done.stats.get("forward_s", 0.0)
        while not state.finished:
            # the span ends before the yield: a span must not stay current while the caller runs
            with telemetry.span("round", trace_parent) as span:
                verdict, facts = await rounds.next()
                telemetry.set_attributes(span, telemetry.round_attributes(facts))
            observer.round(facts)
            if rounds.gateable:  # a sequence whose mode is not the gate's would measure neither mode
                context.costs.gate.emitted(len(verdict.tokens), context.load())
            state.stats.record(verdict.drafted, verdict.accepted, len(verdict.tokens), facts.fallback is not None,
                               facts.batch_size, facts.ahead_hit, facts.prompt)
            state.stats.time(facts)
            yield state.append(verdict.tokens, verdict.logprobs)
    finally:
        rounds.close()
