"""The Dispatcher without a cluster: it relays a target replica's stream and resumes the request on
another replica, from the streamed tokens, when that replica dies (fake handles over real engines)."""

import asyncio

import pytest
from ray.exceptions import RayActorError

from app.engine import Engine, EngineSettings
from app.job import GenerationJob
from app.params import SamplingParams
from app.model.runner import ModelRunner
from conftest import blend
from deployments.args import AppConfig
from deployments.dispatch import Dispatcher
from deployments.vllm_metrics import VLLMMetrics

PROMPT_IDS = list(range(20, 40))
N = 24


class Stream:
    """What handle.options(stream=True).generate.remote(job) returns: an async iterator with cancel()."""

    def __init__(self, gen):
        self.gen, self.cancelled = gen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    def cancel(self):
        self.cancelled = True


class TargetPool:
    """Stands in for the TargetServer deployment: each call goes to a fresh replica (a fresh engine)
    that dies, while `deaths` remain, instead of sending the chunk that would take what it sent past
    `die_after` tokens. Counted in tokens, not chunks: a replica merges the chunks of rounds that ran
    while its stream lagged, so how many chunks carry them depends on timing."""

    def __init__(self, make_engine, die_after: int | None = None, deaths: int = 0):
        self.make_engine, self.die_after, self.deaths = make_engine, die_after, deaths
        self.jobs: list = []  # a copy of each job as it was sent

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, job):
        self.jobs.append((list(job.output_ids), job.controller))
        return Stream(self._replica(job))

    async def _replica(self, job):
        engine = self.make_engine()
        sent = 0
        async for chunk in engine.run_job(job):
            before, sent = sent, sent + len(chunk.get("token_ids", []))
            # (with die_after > 0 it first sends something, so the next replica resumes mid-request)
            due = sent > self.die_after or "finish_reason" in chunk if self.die_after is not None else False
            if self.deaths and due and (before or not self.die_after):
                self.deaths -= 1
                raise RayActorError()
            yield chunk


@pytest.fixture()
def make_engine(target_model, tokenizer):
    draft_model = blend(target_model, 7, 0.9)
    return lambda: Engine(ModelRunner(target_model, tokenizer), ModelRunner(draft_model, tokenizer), EngineSettings(k_max=6))


def params(**kw) -> dict:
    return SamplingParams(max_tokens=N, ignore_eos=True, **{"temperature": 0, **kw}).model_dump()


def run(router: Dispatcher, p: dict) -> tuple[list[int], str, dict]:
    async def collect():
        tokens, text, last = [], "", None
        async for chunk in router.generate(GenerationJob.new(PROMPT_IDS, SamplingParams.model_validate(p), "r1")):
            tokens += chunk.get("token_ids", [])
            text += chunk.get("text", "")
            last = chunk
        return tokens, text, last
    return asyncio.run(collect())


async def _no_sleep(_):
    return None


def make_router(pool: TargetPool, retries: int = 3) -> Dispatcher:
    return Dispatcher(pool, AppConfig.model_validate({"limits": {"target_retries": retries}}), VLLMMetrics("target"),
                      sleep=_no_sleep)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"])
def test_a_replica_dying_mid_request_resumes_identically_from_the_streamed_tokens(make_engine, sampling):
    whole, whole_text, _ = run(make_router(TargetPool(make_engine)), params(**sampling))
    pool = TargetPool(make_engine, die_after=N // 3, deaths=2)
    tokens, text, last = run(make_router(pool), params(**sampling))
    assert tokens == whole and text == whole_text  # nothing lost, nothing repeated, same draws
    assert len(pool.jobs) == 3 and last["finish_reason"] == "length"
    resumed_from, controller = pool.jobs[1]
    assert resumed_from and controller is not None  # the second replica started from the streamed state


def test_router_output_is_the_targets(make_engine, target_model, tokenizer):
    reference = Engine(ModelRunner(target_model, tokenizer)).generate(
        [PROMPT_IDS], SamplingParams(**params(speculation={"enabled": False})))[0].token_ids
    tokens, _, last = run(make_router(TargetPool(make_engine)), params())
    assert tokens == reference
    assert last["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": N,
                             "total_tokens": len(PROMPT_IDS) + N}


def test_target_gone_for_good_ends_with_a_clear_error(make_engine):
    pool = TargetPool(make_engine, die_after=0, deaths=100)
    tokens, _, last = run(make_router(pool, retries=1), params())
    assert tokens == [] and last["error"]["code"] == 503
    assert len(pool.jobs) == 2  # the first try and one retry
