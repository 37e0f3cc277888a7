"""The Router's request loop without a cluster: fail open, retry, load-aware K (fake handles)."""

import asyncio

import pytest
from ray.exceptions import RayActorError

from app.engine import Engine
from app.params import SamplingParams
from app.runner import ModelRunner
from app.spec import propose, verify
from conftest import blend
from deployments.config import AppConfig
from deployments.router import Router

PROMPT_IDS = list(range(20, 40))
N = 24


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class Handle:
    """Stands in for a DeploymentHandle: handle.method.remote(...) is awaitable.

    Like the servers, it takes a router's coalesced `Calls` on `<method>_many`, item by item.
    """

    def __init__(self, **methods):
        self.calls: list[int] = []  # items per coalesced call
        for name, fn in methods.items():
            setattr(self, name, Method(fn))
            setattr(self, f"{name}_many", Method(self._many(fn)))

    def _many(self, fn):
        async def many(calls):
            self.calls.append(len(calls.items))
            return await asyncio.gather(*(fn(item) for item in calls.items), return_exceptions=True)
        return many


async def _noop(*_):
    return None


@pytest.fixture()
def runners(target_model, tokenizer):
    return ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.9), tokenizer)


@pytest.fixture()
def reference(target_model, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation={"enabled": False})
    return Engine(ModelRunner(target_model, tokenizer)).generate([PROMPT_IDS], params)[0].token_ids


def make_router(model_dirs, runners, *, draft_fn=None, target_fn=None, **speculation) -> Router:
    target_runner, draft_runner = runners

    async def good_propose(item):
        return propose(draft_runner, [item])[0]

    async def good_verify(item):
        return verify(target_runner, [item])[0]

    cfg = AppConfig.model_validate({"speculation": {"draft_timeout_s": 0.5, **speculation},
                                    "limits": {"target_retries": 3}})
    draft = Handle(propose=draft_fn or good_propose, release=_noop)
    target = Handle(verify=target_fn or (lambda item: good_verify(item)), release=_noop)
    return Router(draft, target, cfg, model_dirs["target"], max_context=256)


def run(router: Router, spec: dict | None = None) -> tuple[list[int], dict]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation=spec or {}).model_dump()

    async def collect():
        tokens, last = [], None
        async for chunk in router.generate("r1", PROMPT_IDS, params):
            tokens += chunk.get("token_ids", [])
            last = chunk
        return tokens, last
    return asyncio.run(collect())


def test_router_output_is_the_targets(model_dirs, runners, reference):
    tokens, last = run(make_router(model_dirs, runners), {"num_tokens": 3})
    assert tokens == reference and last["finish_reason"] == "length"
    assert last["speculation"]["drafted_tokens"] > 0


def test_concurrent_requests_share_deployment_calls(model_dirs, runners, reference):
    """Rounds of concurrent requests go out as one call per pool (then batched by the server)."""
    router = make_router(model_dirs, runners)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation={"num_tokens": 3}).model_dump()

    async def one(i: int) -> list[int]:
        tokens = []
        async for chunk in router.generate(f"r{i}", PROMPT_IDS, params):
            tokens += chunk.get("token_ids", [])
        return tokens

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(6)))
    assert asyncio.run(all_of_them()) == [reference] * 6
    assert max(router.target.calls) == 6 and max(router.draft.calls) == 6
    assert len(router.target.calls) < sum(router.target.calls)  # fewer calls than rounds
    assert not router._homes  # every request's homes are forgotten when it ends


def test_draft_past_its_deadline_falls_open(model_dirs, runners, reference):
    async def slow(item):
        await asyncio.sleep(5)

    tokens, last = run(make_router(model_dirs, runners, draft_fn=slow), {"num_tokens": 3})
    assert tokens == reference
    spec = last["speculation"]
    # every round but the last (room for one token only: nothing to draft) fell open
    assert spec["drafted_tokens"] == 0 and spec["rounds"] == N and spec["fallback_rounds"] == N - 1


def test_dead_target_replica_is_retried_without_repeats(model_dirs, runners, reference):
    calls = {"n": 0}
    target_runner = runners[0]

    async def flaky(item):
        calls["n"] += 1
        if calls["n"] % 3 == 0:  # every third call lands on a replica that just died
            raise RayActorError()
        return verify(target_runner, [item])[0]

    tokens, last = run(make_router(model_dirs, runners, target_fn=flaky), {"num_tokens": 2})
    assert tokens == reference  # nothing lost, nothing repeated
    assert calls["n"] > last["speculation"]["rounds"]


def test_target_gone_for_good_ends_with_a_clear_error(model_dirs, runners):
    async def dead(item):
        raise RayActorError()

    router = make_router(model_dirs, runners, target_fn=dead)
    router.cfg.limits.target_retries = 1
    tokens, last = run(router)
    assert tokens == [] and last["error"]["code"] == 503


def test_heavy_target_load_turns_speculation_down(model_dirs, runners, reference):
    target_runner = runners[0]

    def loaded(batch_size):
        async def fn(item):
            await asyncio.sleep(0.05)  # a target step well above the draft's: speculation pays when unloaded
            v = verify(target_runner, [item])[0]
            v.stats["batch_size"] = batch_size  # as if the target's batches held this many sequences
            return v
        return fn

    light = run(make_router(model_dirs, runners, target_fn=loaded(1), verify_saturation_tokens=16))
    heavy = run(make_router(model_dirs, runners, target_fn=loaded(256), verify_saturation_tokens=16))
    assert light[0] == heavy[0] == reference
    assert heavy[1]["speculation"]["drafted_tokens"] < light[1]["speculation"]["drafted_tokens"]
    assert heavy[1]["speculation"]["fallback_rounds"] > light[1]["speculation"]["fallback_rounds"]
