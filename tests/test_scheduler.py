"""The round scheduler without Ray: continuous batching of prompts and verify rounds, drafting ahead,
per-sequence fail-open, resuming from streamed tokens, and releasing caches mid-forward."""

import asyncio
import collections

import pytest
import torch

from app.speculation.controller import CostEstimator
from app.speculation.gate import GoodputGate
from app.speculation.driver import DraftPolicy, DraftUnavailable
from app.engine import Engine, EngineSettings
from app.scheduler import ForwardQueue
from app.params import SamplingParams
from app.job import GenerationJob
from app.model.runner import ModelRunner, SeqInput
from conftest import blend

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(10, 90)), [42] * 12]
N = 20


def greedy(**spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation=spec)


def seeded(seed: int, **spec) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=N, ignore_eos=True, seed=seed, speculation=spec)


@pytest.fixture()
def draft_model(target_model):
    return blend(target_model, 7, 0.9)


class DraftLags(CostEstimator):
    """Proposals take longer than a verify round: rounds wait for them, company or not; and the cost
    ratio c is the prior, not measured. Tests that count hits, fallbacks or drafted tokens must not
    depend on how fast this machine drafts."""

    draft_keeps_up = False

    @property
    def c(self) -> float:
        return self.config.prior_c


@pytest.fixture()
def engine(target_model, draft_model, tokenizer):
    def make(ahead: bool = True, draft=None, **kw) -> Engine:
        target = ModelRunner(target_model, tokenizer)
        eng = Engine(target, draft or ModelRunner(draft_model, tokenizer),
                     EngineSettings(k_max=6, policy=DraftPolicy(ahead=ahead), **kw))
        eng.costs = DraftLags()
        return eng
    return make


@pytest.fixture()
def reference(target_model, tokenizer):
    plain = Engine(ModelRunner(target_model, tokenizer))
    return {tuple(p): plain.generate([p], greedy(enabled=False))[0].token_ids for p in PROMPTS}


class Recording:
    """Wraps a transport; records, per forward, which sequences it held and their new-token counts."""

    def __init__(self, queue: ForwardQueue):
        self.queue, self.batches = queue, []
        self.verifying = False  # a forward holding a verify round (a proposal) is running now
        forward = queue.forward

        async def spy(items):
            self.batches.append([(it.seq_id, len(it.token_ids), len(it.proposal.tokens)) for it in items])
            self.verifying = any(it.proposal.tokens for it in items)
            try:
                return await forward(items)
            finally:
                self.verifying = False
        queue.forward = spy

    async def submit(self, item):
        return await self.queue.submit(item)

    async def release(self, seq_id):
        await self.queue.release(seq_id)


class PromptsMeetRounds:
    """Holds each later request's prompt until another request submits a verify round, so both reach
    the forward queue in the same event-loop turn (prompts no longer wait for the draft, so in a test
    this small they would otherwise arrive between rounds)."""

    def __init__(self, inner):
        self.inner, self.round = inner, asyncio.Event()

    async def submit(self, item):
        if item.proposal.tokens:
            self.round.set()
            self.round = asyncio.Event()
        elif item.seq_id != "req-0" and len(item.token_ids) == len(PROMPTS[int(item.seq_id[4:])]):
            async with asyncio.timeout(30):  # bounded; no wait_for: its task would wake a turn late
                await self.round.wait()
        return await self.inner.submit(item)

    async def release(self, seq_id):
        await self.inner.release(seq_id)


def run_staggered(engine: Engine, params_list: list[SamplingParams], prompts=PROMPTS, gap_rounds: int = 2,
                  ready=lambda: True):
    """Start the requests one after another, each once the one before has run `gap_rounds` rounds (or
    finished) and `ready()` holds, so prompts join batches that are already verifying other requests'
    rounds."""
    states = [engine.new_request(p, sp, request_id=f"req-{i}") for i, (p, sp) in enumerate(zip(prompts, params_list))]

    async def go():
        async def one(i, s):
            before = states[i - 1] if i else None
            for _ in range(5_000):  # bounded in count (and so in time, at a millisecond each)
                if before is None or before.finished or (before.stats.rounds >= gap_rounds and ready()):
                    break
                await asyncio.sleep(0.001)
            async for _ in engine.stream(s):
                pass
        await asyncio.gather(*(one(i, s) for i, s in enumerate(states)))
    asyncio.run(go())
    return states


def test_prompts_join_batches_of_verify_rounds_and_output_stays_the_targets(engine, reference):
    eng = engine()
    spy = Recording(eng.verifier)
    eng.verifier = PromptsMeetRounds(spy)
    states = run_staggered(eng, [greedy(num_tokens=3)] * len(PROMPTS), gap_rounds=3)
    for p, s in zip(PROMPTS, states):
        assert s.output_ids == reference[tuple(p)]
    # some forward held a prompt (nothing emitted yet, no proposal) beside another request's verify round
    prompt_lengths = {f"req-{i}": len(p) for i, p in enumerate(PROMPTS)}
    mixed = [b for b in spy.batches
             if any(n == prompt_lengths[sid] for sid, n, _ in b) and any(k > 0 for _, _, k in b)]
    assert mixed, spy.batches


@pytest.mark.parametrize("params", [greedy(num_tokens=4), greedy(), seeded(3, num_tokens=4), seeded(5)],
                         ids=["greedy-k4", "greedy-auto", "seeded-k4", "seeded-auto"])
def test_drafting_ahead_changes_timing_never_tokens(engine, target_model, tokenizer, params):
    closer = blend(target_model, 7, 0.95)  # agrees more often: drafted-ahead proposals get used
    with_ahead = engine(ahead=True, draft=ModelRunner(closer, tokenizer)).generate(PROMPTS, params)
    without = engine(ahead=False, draft=ModelRunner(closer, tokenizer)).generate(PROMPTS, params)
    assert [r.token_ids for r in with_ahead] == [r.token_ids for r in without]
    assert all(r.speculation["draft_ahead_hit_rate"] == 0 for r in without)
    if params.greedy and params.speculation.pinned_k() is None:
        return  # greedy adaptive K weighs measured costs: whether it drafts at all is the machine's call
    rates = [r.speculation["draft_ahead_hit_rate"] for r in with_ahead]
    assert max(rates) > 0  # hits happen...
    assert min(rates) < 1  # ...and misses: rounds whose proposal drafted ahead was for the wrong context


def test_branches_hide_the_draft_after_rejections_and_change_no_token(target_model, tokenizer):
    """A greedy request alone drafts ahead for its round's likeliest rejections too (the draft's
    runner-ups at positions 0 and 1): the round that ends in one finds its proposal drafted. Tokens
    are the same with and without; more rounds find their proposal ready; every branch's draft cache
    is freed with the request."""
    from app.speculation.steps import BRANCH_SLOTS

    draft = ModelRunner(blend(target_model, 7, 0.8), tokenizer)  # disagrees often: rounds end in rejections

    def run(branches: int):
        eng = Engine(ModelRunner(target_model, tokenizer), draft,
                     EngineSettings(k_max=6, policy=DraftPolicy(ahead=True, branches=branches)))
        eng.costs = DraftLags()
        out = [eng.generate([p], greedy(num_tokens=4))[0] for p in PROMPTS]  # one at a time: alone
        return out, sum(r.speculation["draft_ahead_hit_rate"] for r in out)
    (plain, hits_without), (branched, hits_with) = run(0), run(2)
    assert [r.token_ids for r in branched] == [r.token_ids for r in plain]
    assert hits_with > hits_without
    # every request's branch caches are freed with it (retired as prefix donors); the last request's
    # cancelled branch forwards may still finish after its generate() call's event loop is gone, so
    # only its branches may be left live
    live = [k for k in draft.cache._entries if k not in draft.cache._retired]
    assert len({k.split("#")[0] for k in live}) <= 1 and len(live) <= BRANCH_SLOTS, live


def test_a_proposal_in_hand_keeps_what_drafting_ahead_needs():
    """A proposal drafted ahead, when used, still carries its guess and runner-ups, so the round that
    uses it drafts ahead (and branches) in turn."""
    from app.speculation.ahead import Ahead, hidden
    from app.speculation.steps import Proposal

    drafted = Proposal([1, 2], torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), {"steps": 3}, guess=3,
                       runner_ups=[[4, 6], [5, 7]])
    used = hidden(drafted, Ahead([0], task=None, started=1.0, finished=1.5), waited=2.0)
    assert (used.guess, used.runner_ups, used.stats) == (3, [[4, 6], [5, 7]], {"steps": 3, "hidden_s": 0.5})


def test_a_greedy_proposal_gives_the_drafts_runner_ups_where_asked(draft_model, tokenizer):
    from app.speculation.steps import RUNNER_UP_POSITIONS, ProposeItem
    from app.speculation.drafting import propose

    runner = ModelRunner(draft_model, tokenizer)
    context = list(range(3, 20))
    asked, sampled = propose(runner, [ProposeItem("a", context, 4, greedy(), 0, runner_ups=2),
                                      ProposeItem("b", context, 4, seeded(1), 1, runner_ups=2)])
    assert sampled.runner_ups is None  # a sampled request's correction is no argmax to guess
    assert len(asked.runner_ups) == RUNNER_UP_POSITIONS and all(len(r) == 2 for r in asked.runner_ups)
    logits = draft_model(torch.tensor([context + asked.tokens[:1]])).logits[0, -2:]
    for j in range(RUNNER_UP_POSITIONS):
        top = logits[j].topk(3).indices.tolist()
        assert top[0] == asked.tokens[j] and asked.runner_ups[j] == top[1:]
    assert propose(runner, [ProposeItem("c", context, 4, greedy(), 0)])[0].runner_ups is None


class FailingFor:
    """A draft transport that fails every proposal of some sequences and serves the others."""

    def __init__(self, inner: ForwardQueue, failing: set[str]):
        self.inner, self.failing, self.asked = inner, failing, []

    async def submit(self, item):
        self.asked.append(item.seq_id)
        if item.seq_id in self.failing:
            raise DraftUnavailable("draft replica died", "draft_unavailable")
        return await self.inner.submit(item)

    async def release(self, seq_id):
        await self.inner.release(seq_id)


def test_a_draft_failure_falls_open_for_that_sequence_only(engine, draft_model, tokenizer, reference):
    eng = engine()
    eng.drafter = FailingFor(eng.drafter, {"req-1"})
    states = run_staggered(eng, [greedy(num_tokens=3)] * len(PROMPTS), gap_rounds=0)
    for p, s in zip(PROMPTS, states):
        assert s.output_ids == reference[tuple(p)]
    failed, others = states[1], [s for i, s in enumerate(states) if i != 1]
    assert failed.stats.fallback_rounds > 0 and failed.stats.drafted_tokens == 0
    assert all(s.stats.fallback_rounds == 0 and s.stats.drafted_tokens > 0 for s in others)
    # after a failure the sequence backs off: it does not ask the draft every round
    assert eng.drafter.asked.count("req-1") < failed.stats.rounds


def test_seeded_output_does_not_depend_on_the_batch_or_other_requests_draft_failures(engine):
    params = [seeded(7), seeded(8, num_tokens=3), seeded(9), greedy()]
    alone = [engine().generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    eng = engine()
    eng.drafter = FailingFor(eng.drafter, {"req-1", "req-3"})  # other requests' drafts fail
    together = run_staggered(eng, params, gap_rounds=1)
    assert [s.output_ids for s in together][0::2] == alone[0::2]
    assert together[0].stats.drafted_tokens > 0 and together[1].stats.fallback_rounds > 0


class NeverAnswers:
    async def submit(self, item):
        await asyncio.Event().wait()

    async def release(self, seq_id):
        pass


def test_a_draft_past_its_deadline_falls_open(engine, target_model, tokenizer, reference):
    eng = Engine(ModelRunner(target_model, tokenizer), NeverAnswers(),
                 EngineSettings(policy=DraftPolicy(timeout_s=0.01, retry_after_s=3600.0)))
    r = eng.generate([PROMPTS[0]], greedy(num_tokens=3))[0]
    assert r.token_ids == reference[tuple(PROMPTS[0])]
    # every round fell back but the first (the prompt's prefill: a plain step by design) and perhaps the
    # last (it may have had room for one token only, and asked nothing)
    assert r.speculation["fallback_rounds"] >= r.speculation["rounds"] - 2 > 0
    assert r.speculation["drafted_tokens"] == 0


def collect(engine: Engine, job: GenerationJob, stop_after: int | None = None) -> list[dict]:
    async def go():
        chunks = []
        stream = engine.run_job(job)
        async for chunk in stream:
            chunks.append(chunk)
            job.record(chunk)
            if stop_after is not None and len(chunks) == stop_after:
                await stream.aclose()  # the replica "dies" here
                break
        return chunks
    return asyncio.run(go())


@pytest.mark.parametrize("params", [greedy(), seeded(21), seeded(22, num_tokens=2)], ids=["greedy", "seeded-auto",
                                                                                            "seeded-k2"])
def test_a_job_resumed_from_streamed_tokens_continues_identically(engine, params):
    whole = collect(engine(), GenerationJob("r", PROMPTS[0], params.model_dump(), seed=1234))
    job = GenerationJob("r", PROMPTS[0], params.model_dump(), seed=1234)
    first = collect(engine(), job, stop_after=3)
    rest = collect(engine(), job)  # a fresh replica: no caches, only the job
    tokens = lambda chunks: [t for c in chunks for t in c["token_ids"]]  # noqa: E731
    text = lambda chunks: "".join(c["text"] for c in chunks)  # noqa: E731
    assert tokens(first) + tokens(rest) == tokens(whole)
    assert text(first) + text(rest) == text(whole)
    assert rest[-1]["usage"] == whole[-1]["usage"]


def test_load_on_the_target_turns_speculation_down(engine, reference):
    light = engine(verify_cost=lambda: 0.0).generate([PROMPTS[0]], greedy())[0]
    heavy = engine(verify_cost=lambda: 2.0).generate([PROMPTS[0]], greedy())[0]
    assert light.token_ids == heavy.token_ids == reference[tuple(PROMPTS[0])]
    assert heavy.speculation["drafted_tokens"] < light.speculation["drafted_tokens"]


def test_a_release_during_the_forward_computing_the_sequence_still_frees_it(target_runner):
    async def go():
        async def forward(items):
            await queue.release("a")  # the request ends while its last round computes...
            target_runner.forward([SeqInput("a", [2, 3, 4], 1)])  # ...which then stores the cache
            assert "a" in target_runner.cache
            return [type("R", (), {"stats": {}})() for _ in items]
        queue = ForwardQueue(forward, target_runner.release, name="test")
        await queue.submit(type("I", (), {"seq_id": "a", "trace": None})())
    asyncio.run(go())
    assert "a" not in target_runner.cache and len(target_runner.cache) == 0  # retired again after the forward


class CancelsItsCalls:
    """A draft pool that cancels the calls it was sent (a replica shutting down): not the request's doing."""

    async def submit(self, item):
        raise asyncio.CancelledError()

    async def release(self, seq_id):
        pass


def test_a_proposal_cancelled_by_the_draft_side_falls_open_instead_of_stalling(target_model, tokenizer, reference):
    eng = Engine(ModelRunner(target_model, tokenizer), CancelsItsCalls())
    r = eng.generate([PROMPTS[0]], greedy(num_tokens=3))[0]
    assert r.token_ids == reference[tuple(PROMPTS[0])]
    assert r.speculation["fallback_rounds"] > 0 and r.speculation["drafted_tokens"] == 0


class DraftKeepsUp(CostEstimator):
    """The draft answers within a verify round (the measured figures say so on a loaded replica)."""

    draft_keeps_up = True


class FactsByRequest:
    def __init__(self):
        self.facts = []

    def round(self, facts):
        self.facts.append(facts)


def run_with_facts(engine: Engine, params_list: list[SamplingParams]) -> tuple[list, list]:
    states = [engine.new_request(p, sp, request_id=f"req-{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params_list))]
    observers = [FactsByRequest() for _ in states]

    async def go():
        async def one(s, obs):
            async for _ in engine.stream(s, observer=obs):
                pass
        await asyncio.gather(*(one(s, o) for s, o in zip(states, observers)))
    asyncio.run(go())
    return states, [o.facts for o in observers]


class DraftFirst:
    """Transports where every verify waits until the draft has answered all it was asked: the draft
    is faster than the target, deterministically (in process both share two threads)."""

    def __init__(self, engine: Engine):
        self.target, self.draft, self.in_flight = engine.verifier, engine.drafter, 0
        self.idle = asyncio.Event()
        engine.verifier, engine.drafter = self, self

    async def submit(self, item):
        if hasattr(item, "proposal"):  # a verify round
            # a draft asked just before this verify (drafting ahead) is a task that reaches submit a few
            # turns of the loop later: let it, or the verify would start beside it and the draft's thread
            # race the target's (under load the draft lost, and no round found its proposal ready)
            for _ in range(20):
                await asyncio.sleep(0)
            if self.in_flight:
                self.idle.clear()
                await asyncio.wait_for(self.idle.wait(), 60)
            return await self.target.submit(item)
        self.in_flight += 1
        try:
            return await self.draft.submit(item)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    async def release(self, seq_id):
        await self.target.release(seq_id)
        await self.draft.release(seq_id)


def test_with_company_a_round_never_waits_for_the_draft_and_output_stays_the_targets(engine, target_model,
                                                                                      tokenizer, reference):
    eng = engine(draft=ModelRunner(blend(target_model, 7, 0.95), tokenizer))
    eng.costs = DraftKeepsUp()
    DraftFirst(eng)
    states, facts = run_with_facts(eng, [greedy(num_tokens=3)] * len(PROMPTS))
    for p, s in zip(PROMPTS, states):
        assert s.output_ids == reference[tuple(p)]
    rounds = [f for per in facts for f in per]
    # a proposal not in hand: a plain step in the same forward, the draft proposing from there...
    assert any(f.fallback == "draft_behind" for f in rounds)
    # ...and rounds that used a proposal drafted while earlier rounds verified (shifted or whole)
    assert any(f.ahead_hit and f.drafted > 0 for f in rounds)


def test_alone_or_seeded_a_round_waits_for_its_proposal(engine, target_model, tokenizer):
    eng = engine(draft=ModelRunner(blend(target_model, 7, 0.95), tokenizer))
    eng.costs = DraftKeepsUp()
    _, facts = run_with_facts(eng, [seeded(40 + i, num_tokens=3) for i in range(len(PROMPTS))])
    assert not any(f.fallback == "draft_behind" for per in facts for f in per)  # its K must not follow load
    _, (alone,) = run_with_facts(eng, [greedy(num_tokens=3)])
    assert not any(f.fallback == "draft_behind" for f in alone) and any(f.drafted for f in alone)


def test_a_long_prompt_is_prefilled_in_chunks_beside_other_rounds(engine, reference, target_model, tokenizer):
    eng = engine(prefill_chunk=16)
    runner = eng.target
    computed = []  # per target forward: new tokens computed for each sequence
    open_batch = runner.open

    def spy(seqs):
        batch = open_batch(seqs)
        computed.append({s.seq_id: len(s.token_ids) - r for s, r in zip(seqs, batch.reuse)})
        return batch
    runner.open = spy
    states = run_staggered(eng, [greedy(num_tokens=3)] * len(PROMPTS), gap_rounds=3)
    for p, s in zip(PROMPTS, states):
        assert s.output_ids == reference[tuple(p)]
    long_id = f"req-{PROMPTS.index(list(range(10, 90)))}"  # 80 prompt tokens: five chunks
    assert max(step.get(long_id, 0) for step in computed) <= 16 + 3  # a chunk, or the last one and 3 drafted
    assert sum(1 for step in computed if long_id in step) >= 5
    assert any(long_id in step and len(step) > 1 for step in computed)  # chunks share forwards


class FailsFirst:
    """A draft transport whose first `n` proposals of each sequence fail (a replica killed mid-call)."""

    def __init__(self, inner: ForwardQueue, n: int):
        self.inner, self.n, self.failed = inner, n, collections.Counter()

    async def submit(self, item):
        if self.failed[item.seq_id] < self.n:
            self.failed[item.seq_id] += 1
            raise DraftUnavailable("draft replica died", "draft_unavailable")
        return await self.inner.submit(item)

    async def release(self, seq_id):
        await self.inner.release(seq_id)


def test_a_seeded_request_asks_again_so_a_dead_draft_replica_changes_nothing(engine):
    params = [seeded(7), seeded(8, num_tokens=3)]
    undisturbed = [engine().generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    eng = engine()
    eng.policy = DraftPolicy(seeded_backoff_s=0.0)
    eng.drafter = FailsFirst(eng.drafter, 2)
    disturbed = [eng.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [r.token_ids for r in disturbed] == [r.token_ids for r in undisturbed]
    assert all(r.speculation["fallback_rounds"] == 0 for r in disturbed) and sum(eng.drafter.failed.values()) == 4
    # a pool that stays down: the request falls open after its retries, and still completes
    eng.drafter = FailsFirst(eng.drafter.inner, 10**6)
    alone = eng.generate([PROMPTS[0]], seeded(7))[0]
    assert len(alone.token_ids) == len(undisturbed[0].token_ids)
    assert alone.speculation["fallback_rounds"] > 0


class PlainFaster(GoodputGate):
    """A gate that has measured plain steps faster at every load."""

    def allows(self) -> bool:
        return False


def test_where_the_gate_measured_plain_steps_faster_flexible_requests_never_call_the_draft(
        target_model, tokenizer, draft_model, reference):
    eng = Engine(ModelRunner(target_model, tokenizer), ModelRunner(draft_model, tokenizer),
                 EngineSettings(k_max=6, policy=DraftPolicy(ahead=True), goodput_gate=True))
    eng.costs = DraftLags(gate=PlainFaster())
    eng.active = 1  # another request in flight throughout: the gate decides for sequences with company
    out = eng.generate([PROMPTS[0], PROMPTS[2]], greedy())
    assert [r.token_ids for r in out] == [reference[tuple(PROMPTS[0])], reference[tuple(PROMPTS[2])]]
    assert all(r.speculation["drafted_tokens"] == 0 for r in out)
    assert not eng.drafter.batch_sizes  # not beside the prefill, not ahead: the draft never ran
    # a request alone is its own controller's to decide: its rounds carry every cost it pays
    eng.active = 0
    alone = eng.generate([PROMPTS[0]], greedy())[0]
    assert alone.token_ids == reference[tuple(PROMPTS[0])] and alone.speculation["drafted_tokens"] > 0
    eng.active = 1
    # a pinned K and a seeded sampled request are the user's and the request's own: not gated
    pinned = eng.generate([PROMPTS[0]], greedy(num_tokens=3))[0]
    seeded = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert pinned.token_ids == reference[tuple(PROMPTS[0])]
    assert pinned.speculation["drafted_tokens"] > 0 and seeded.speculation["drafted_tokens"] > 0


class CountingGate(GoodputGate):
    """A gate that counts the rounds it is told of."""

    def __init__(self):
        super().__init__()
        self.rounds = 0

    def emitted(self, tokens: int, active: int) -> None:
        self.rounds += 1
        super().emitted(tokens, active)


def test_the_gate_measures_only_rounds_whose_mode_it_decides(engine):
    """Requests with speculation off, a pinned K or a seed take the mode they ask for: their rounds would
    be counted as whichever mode the gate's window was in, and set its rates from rounds it did not run."""
    eng = engine()
    eng.costs = DraftLags(gate=CountingGate())
    eng.generate([PROMPTS[0]], greedy(enabled=False))
    eng.generate([PROMPTS[0]], greedy(num_tokens=3))
    eng.generate([PROMPTS[0]], seeded(3))
    assert eng.costs.gate.rounds == 0
    flexible = eng.generate([PROMPTS[0]], greedy())[0]
    assert eng.costs.gate.rounds == flexible.speculation["rounds"] > 0


def test_an_engine_without_the_gate_never_consults_one(engine):
    eng = engine()
    assert eng.costs.gate is None
    assert eng.generate([PROMPTS[0]], greedy())[0].speculation["drafted_tokens"] > 0


@pytest.mark.parametrize("beside_cached", [True, False])
def test_beside_a_prefill_the_targets_cache_holds_the_draft_is_asked_only_where_configured(
        target_model, tokenizer, draft_model, reference, beside_cached):
    eng = Engine(ModelRunner(target_model, tokenizer), ModelRunner(draft_model, tokenizer),
                 EngineSettings(k_max=6, policy=DraftPolicy(ahead=True, beside_cached=beside_cached)))
    eng.costs = DraftLags()
    contexts = []  # every context the draft was asked to draft for
    submit = eng.drafter.submit

    async def spy(item):
        contexts.append(list(item.token_ids))
        return await submit(item)
    eng.drafter.submit = spy
    prompt = PROMPTS[2]  # 80 tokens: five whole prefix blocks
    first = eng.generate([prompt], greedy())[0]
    assert contexts.count(prompt) == 1  # new to the target's cache: its prefill is drafted beside, either way
    contexts.clear()
    again = eng.generate([prompt], greedy())[0]  # the target's cache now holds it to its last block
    assert contexts.count(prompt) == (1 if beside_cached else 0)
    assert contexts  # the draft still drafted every later round (it caught up in the second)
    assert first.token_ids == again.token_ids == reference[tuple(prompt)]
    assert again.speculation["drafted_tokens"] > 0
