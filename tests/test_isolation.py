"""One request never fails another: a batch whose forward raises runs again in parts, the item that
raised fails alone, the others get exactly what they would have got; only a fault of the replica
itself fails a batch, and under tensor parallelism only such a fault marks the rank group failed."""

import asyncio
import functools

import pytest
import torch
from ray.exceptions import ActorDiedError, RayTaskError

from app.errors import ReplicaFault
from app.scheduler import ForwardQueue, in_thread
from app.params import SamplingParams
from app.model.runner import ModelRunner
from app.speculation.steps import Proposal, VerifyItem, verify, ProposeItem
from app.speculation.drafting import propose
from conftest import blend
from app.errors import RankFailure
from deployments.tp import group_result

PROMPTS = [[0, 5, 6, 7], [0, 9, 9], [0, 40, 41, 42, 43], [0, 3]]


def poisoned(params: SamplingParams) -> SamplingParams:
    """Params no front door lets through (top_k outside int64): what the edge's checks exist to stop,
    standing in for any bad value that reaches a shared forward."""
    return params.model_copy(update={"top_k": 2**70})


def run_batch(queue: ForwardQueue, items: list) -> list:
    """Submit the items in one loop turn (one batch); each one's result or exception."""
    async def go():
        return await asyncio.gather(*(queue.submit(it) for it in items), return_exceptions=True)
    return asyncio.run(go())


def verify_queue(runner: ModelRunner) -> ForwardQueue:
    return ForwardQueue(in_thread(functools.partial(verify, runner)), runner.release, name="verify",
                        forget=runner.forget)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bad_item_fails_alone_and_its_batch_gets_exactly_its_results(target_model, tokenizer, temperature):
    params = SamplingParams(temperature=temperature, seed=3)
    draft = Proposal([11, 12], torch.tensor([[11], [12]]), torch.ones(2, 1))
    good = [VerifyItem(f"s{i}", p, draft, params, seed=i) for i, p in enumerate(PROMPTS)]
    alone = [verify(ModelRunner(target_model, tokenizer), [it])[0] for it in good]

    runner = ModelRunner(target_model, tokenizer)
    queue = verify_queue(runner)
    # a first round caches every sequence, so the failing batch below finds warm caches
    run_batch(queue, [VerifyItem(it.seq_id, it.token_ids[:-1], Proposal.empty(), params, it.seed) for it in good])
    bad = VerifyItem("bad", [0, 1, 2], draft, poisoned(SamplingParams(temperature=1.0)), seed=9)
    results = run_batch(queue, good[:2] + [bad] + good[2:])
    assert queue.batch_sizes[-1] == 5  # they did share one forward
    assert isinstance(results[2], Exception) and queue.isolated == 1
    got = results[:2] + results[3:]
    assert [(v.tokens, v.accepted) for v in got] == [(v.tokens, v.accepted) for v in alone]
    # the next round of every good sequence is still the one of an undisturbed run
    nxt = [VerifyItem(it.seq_id, it.token_ids + v.tokens, Proposal.empty(), params, it.seed)
           for it, v in zip(good, got)]
    fresh = [verify(ModelRunner(target_model, tokenizer), [it])[0].tokens for it in nxt]
    assert [v.tokens for v in run_batch(queue, nxt)] == fresh


def test_a_bad_proposal_request_fails_alone_on_the_draft(target_model, tokenizer):
    runner = ModelRunner(blend(target_model, 7, 0.85), tokenizer)
    queue = ForwardQueue(in_thread(functools.partial(propose, runner)), runner.release, name="propose",
                         forget=runner.forget)
    params = SamplingParams(temperature=1.0, seed=5)
    items = [ProposeItem(f"s{i}", p, 3, params, seed=i) for i, p in enumerate(PROMPTS)]
    alone = [propose(ModelRunner(runner.model, tokenizer), [it])[0].tokens for it in items]
    bad = ProposeItem("bad", [0, 1], 3, poisoned(params), seed=1)
    results = run_batch(queue, [bad] + items)
    assert isinstance(results[0], Exception)
    assert [p.tokens for p in results[1:]] == alone


def test_a_fault_of_the_replica_fails_the_batch_as_it_is_and_marks_it():
    calls = []

    async def forward(items):
        calls.append(len(items))
        raise ReplicaFault("device lost")
    queue = ForwardQueue(forward, lambda s: None, name="f")
    results = run_batch(queue, [VerifyItem(str(i), [0], Proposal.empty(), SamplingParams(), i) for i in range(4)])
    assert all(isinstance(r, ReplicaFault) for r in results) and calls == [4] and queue.fault


def test_running_out_of_device_memory_runs_the_batch_again_in_parts_and_keeps_the_replica():
    """A batch too big for the device's memory is a request-sized problem, not a fault: it is run
    again in halves, and only an item too big on its own fails, alone; a CUDA error still is a fault."""
    calls = []

    async def forward(items):
        calls.append(len(items))
        if len(items) > 2 or any(it.seq_id == "huge" for it in items):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return [type("R", (), {"stats": {}, "seq": it.seq_id})() for it in items]
    queue = ForwardQueue(forward, lambda s: None, name="f")
    items = [VerifyItem(s, [0], Proposal.empty(), SamplingParams(), i) for i, s in enumerate("abcd")]
    results = run_batch(queue, items[:2] + [VerifyItem("huge", [0], Proposal.empty(), SamplingParams(), 9)] + items[2:])
    assert [getattr(r, "seq", None) for r in results] == ["a", "b", None, "c", "d"]
    assert isinstance(results[2], torch.OutOfMemoryError) and queue.isolated == 1 and not queue.fault
    assert calls == [5, 2, 3, 1, 2]  # whole, then halves, then the failing half's halves

    async def broken(items):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    queue = ForwardQueue(broken, lambda s: None, name="g")
    results = run_batch(queue, items)
    assert all(isinstance(r, RuntimeError) for r in results) and queue.fault


# -- tensor parallelism: what the rank group makes of its ranks' answers --------------------------------
def task_error(cause: Exception) -> RayTaskError:
    return RayTaskError("RankWorker.verify", "traceback", cause)


def test_the_same_request_error_on_every_rank_is_the_requests_and_keeps_the_group():
    with pytest.raises(ValueError) as e:
        group_result([task_error(ValueError("bad top_k")), task_error(ValueError("bad top_k"))])
    assert not isinstance(e.value, RankFailure)
    assert group_result([["rank 0"], ["rank 1"]]) == ["rank 0"]


def test_a_rank_group_serialises_a_batch_once_for_all_its_ranks(monkeypatch):
    """Every round's batch (every sequence's context) went to the object store once per rank."""
    from deployments import tp

    put = []
    monkeypatch.setattr(tp.ray, "put", lambda value: put.append(value) or ("ref", len(put)))

    class Rank:
        def __init__(self, i):
            self.verify, self.got = self, []

        def remote(self, *args):
            self.got.append(args)

            async def answer():
                return [["verdicts"], "cache"]
            return answer()
    group = object.__new__(tp.RankGroup)
    group.ranks, group.timeout_s, group.failed = [Rank(0), Rank(1), Rank(2)], 10.0, None
    batch = [VerifyItem("s", list(range(1000)), Proposal.empty(), SamplingParams(), 0)]
    assert asyncio.run(group._all("verify", batch)) == [["verdicts"], "cache"]
    assert put == [batch]  # one serialisation
    assert [r.got for r in group.ranks] == [[(("ref", 1),)]] * 3  # the same object to every rank


@pytest.mark.parametrize("results", [
    [["ok"], ActorDiedError()],  # a rank died
    [task_error(ValueError("x")), ["ok"]],  # ranks disagree: collectives may be out of step
    [task_error(ValueError("x")), task_error(KeyError("y"))],
    [task_error(RuntimeError("CUDA error: device-side assert triggered"))] * 2,  # a device fault
])
def test_anything_else_fails_the_group(results):
    with pytest.raises(RankFailure):
        group_result(results)


@pytest.mark.parametrize("controller", [(float("nan"), 1.0, 1), (1.0, 1.0, float("nan")), (1.0, float("inf"), 1), (1.0, 1.0), (-1.0, 0, 0)])
def test_a_job_with_bad_controller_state_fails_at_once_with_a_clear_error(target_model, tokenizer, controller):
    """Resume state is checked like user input. Before, int(NaN) raised in the producer before its
    guard, and the stream waited out the request's timeout holding its slot."""
    from app.engine import Engine
    from app.errors import InvalidRequestError
    from app.job import GenerationJob

    engine = Engine(ModelRunner(target_model, tokenizer))
    job = GenerationJob("r", [0, 5, 6], SamplingParams(max_tokens=4).model_dump(), seed=1, controller=controller)

    async def consume():
        return [chunk async for chunk in engine.run_job(job)]
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(asyncio.wait_for(consume(), 60))
    assert e.value.param == "controller"


def test_a_prompts_choices_rank_one_target_replica_first_and_others_keep_power_of_two():
    """n choices of a prompt meet on one replica, whose engine prefills their prompt once
    (tests/test_engine.py); requests without a group keep Serve's two random candidates."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from app.job import GenerationJob
    from deployments.affinity import ChoiceGroupRouter

    @dataclass(frozen=True)
    class ReplicaID:
        unique_id: str

    replicas = [SimpleNamespace(replica_id=ReplicaID(f"r{i}")) for i in range(5)]
    me = SimpleNamespace(apply_locality_routing=lambda pending: {r.replica_id for r in replicas})

    def ranks(group, order):
        job = GenerationJob("x", [0], {}, seed=1, group=group)
        return asyncio.run(ChoiceGroupRouter.choose_replicas(me, [replicas[i] for i in order],
                                                             SimpleNamespace(args=[job])))
    homes = {ranks("cmpl-1/0", order)[0][0].replica_id.unique_id for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1])}
    assert len(homes) == 1 and len(ranks("cmpl-1/0", range(5))[1]) == 4  # the others follow, as for a full home
    assert len({ranks(f"cmpl-{i}/0", range(5))[0][0].replica_id.unique_id for i in range(40)}) > 1  # groups spread
    plain = ranks(None, range(5))
    assert len(plain) == 1 and len(plain[0]) == 2


def test_a_jobs_grammar_is_checked_off_the_event_loop(target_model, tokenizer):
    """Compiling a large schema must not stall the rounds of every other request on the replica."""
    import threading

    from app.engine import Engine
    from app.job import GenerationJob

    engine = Engine(ModelRunner(target_model, tokenizer))
    threads = []
    admit = engine.admit
    engine.admit = lambda job: threads.append(threading.current_thread()) or admit(job)
    job = GenerationJob("r", [0, 5, 6], SamplingParams(max_tokens=2), seed=1)

    async def consume():
        loop_thread = threading.current_thread()
        chunks = [chunk async for chunk in engine.run_job(job)]
        return loop_thread, chunks
    loop_thread, chunks = asyncio.run(consume())
    assert chunks[-1]["finish_reason"] and threads and threads[0] is not loop_thread
