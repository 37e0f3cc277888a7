"""Router: owns every request's state and drives its rounds against the draft and target pools.

Fail open: a draft that errs or misses its deadline makes the round a plain target step, and the
draft is left alone for a while. Retry: a verify whose target replica died is sent again from
the router's state; the round is recomputed identically, so nothing streamed repeats or goes.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from transformers import AutoTokenizer

from app import telemetry
from app.batching import MicroBatcher
from app.controller import CostEstimator, KController, KControllerConfig
from app.driver import DraftUnavailable, run_rounds
from app.params import SamplingParams
from app.request import RequestState
from app.spec import Proposal, ProposeItem, Verdict, VerifyItem
from deployments.affinity import Calls
from deployments.config import AppConfig
from deployments.tp import RankFailure
from deployments.metrics import RouterMetrics

log = logging.getLogger("ray.serve")

REPLICA_GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError, BackPressureError, RankFailure)


def replica_gone(e: BaseException) -> bool:
    """Whether a call failed because its replica (or one of its rank workers) is gone, not the request."""
    return isinstance(e, REPLICA_GONE) or isinstance(getattr(e, "cause", None), REPLICA_GONE)


class TargetUnavailable(Exception):
    """No target replica answered within the retries."""


class Router:
    """One coroutine per request; propose and verify calls go out by deployment handle."""

    def __init__(self, draft, target, cfg: AppConfig, tokenizer_path: str, max_context: int):
        self.draft, self.target, self.cfg = draft, target, cfg
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.max_context = max_context
        self.costs = CostEstimator()
        self.target_batch = 1.0  # EMA of the target's batch size, for load-aware K
        self._draft_down_until = 0.0
        self._draft_down_reason = "draft_unavailable"
        self.active = 0
        self._releases: set[asyncio.Task] = set()
        # one deployment call per pool and event-loop turn carries every request's round, grouped by
        # the replica that holds each sequence's cache (its home); see deployments.affinity
        self._homes: dict[tuple[str, str], str] = {}  # (pool, seq id) -> replica id
        self._draft_calls = MicroBatcher(lambda items, home: self.draft.propose_many.remote(Calls(items, home)),
                                         cfg.draft_batch.max_batch_size)
        self._target_calls = MicroBatcher(lambda items, home: self.target.verify_many.remote(Calls(items, home)),
                                          cfg.target_batch.max_batch_size)
        self.metrics = RouterMetrics()
        telemetry.configure_tracing("router")

    async def _propose(self, item: ProposeItem) -> Proposal:
        if time.monotonic() < self._draft_down_until:
            raise DraftUnavailable("draft pool backing off", self._draft_down_reason)
        try:
            return await asyncio.wait_for(self._call("draft", self._draft_calls, item),
                                          self.cfg.speculation.draft_timeout_s)
        except (asyncio.TimeoutError, *REPLICA_GONE) as e:
            log.warning("draft unavailable (%s); plain target steps for %.1fs", type(e).__name__,
                        self.cfg.speculation.draft_retry_after_s)
            self._draft_down_until = time.monotonic() + self.cfg.speculation.draft_retry_after_s
            self._draft_down_reason = "deadline" if isinstance(e, asyncio.TimeoutError) else "draft_unavailable"
            raise DraftUnavailable(str(e), self._draft_down_reason) from e

    async def _verify(self, item: VerifyItem) -> Verdict:
        retries = self.cfg.limits.target_retries
        for attempt in range(retries + 1):
            try:
                verdict = await self._call("target", self._target_calls, item)
                self.target_batch = 0.8 * self.target_batch + 0.2 * verdict.stats.get("batch_size", 1)
                return verdict
            except Exception as e:
                if not replica_gone(e):
                    raise
                log.warning("verify failed on a gone target replica (%s), attempt %d", type(e).__name__, attempt + 1)
                if attempt == retries:
                    raise TargetUnavailable(str(e)) from e
                self.metrics.retry()
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    async def _call(self, pool: str, calls: MicroBatcher, item: ProposeItem | VerifyItem) -> Proposal | Verdict:
        """Send an item with the others of its home replica; remember where it was served."""
        key = (pool, item.seq_id)
        try:
            result = await calls.submit(item, self._homes.get(key))
        except BaseException:
            self._homes.pop(key, None)  # its home may be gone: let the next call go anywhere
            raise
        if "replica" in result.stats:
            self._homes[key] = result.stats["replica"]
        return result

    def _verify_cost(self) -> float:
        # roofline: a target step costs the same until its batch holds `saturation` tokens, then grows
        # linearly; one more draft token per sequence adds B tokens, i.e. B / saturation of a step
        return self.target_batch / self.cfg.speculation.verify_saturation_tokens

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict,
                       trace: dict | None = None) -> AsyncIterator[dict]:
        """Stream {token_ids, text} per round, then {finish_reason, usage, speculation} (or {error}).

        `trace`: the caller's W3C trace context; the generation span is its child.
        """
        sp = SamplingParams.model_validate(params)
        state = RequestState(request_id, prompt_ids, sp, self.tokenizer, self.max_context)
        controller = KController(KControllerConfig(k_max=self.cfg.speculation.k_max),
                                 pinned_k=sp.speculation.pinned_k() if self.cfg.draft else 0)
        propose = self._propose if self.cfg.draft else None
        observer = self.metrics.request()
        span = telemetry.start_span("generate", trace, {"specserve.prompt_tokens": len(prompt_ids),
                                                        "specserve.max_tokens": sp.max_tokens})
        self.active += 1
        self.metrics.set_active(self.active)
        try:
            async for kept in run_rounds(state, propose, self._verify, controller, self.costs, self._verify_cost,
                                         observer, telemetry.context_of(span)):
                delta = state.take_delta()
                if kept or delta:
                    yield {"token_ids": kept, "text": delta}
            yield {"token_ids": [], "text": state.take_delta(), "finish_reason": state.finish_reason,
                   "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(state.output_ids),
                             "total_tokens": len(prompt_ids) + len(state.output_ids)},
                   "speculation": state.stats.summary()}
        except TargetUnavailable as e:
            yield {"error": {"message": f"no target replica could verify: {e}", "type": "service_unavailable",
                             "code": 503}}
        finally:
            self.active -= 1
            self.metrics.set_active(self.active)
            observer.finish()
            telemetry.set_attributes(span, {"specserve.completion_tokens": len(state.output_ids),
                                            "specserve.rounds": state.stats.rounds,
                                            "specserve.finish_reason": state.finish_reason})
            if span is not None:
                span.end()
            # a task of its own: this generator may be being cancelled (client gone), the release must land
            task = asyncio.ensure_future(self._release(request_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, request_id: str) -> None:
        """Free the request's KV caches on the draft and target replicas that hold them."""
        pools = [("target", self.target)] + ([("draft", self.draft)] if self.cfg.draft else [])
        calls = [handle.release.remote(Calls([request_id], self._homes.pop((pool, request_id), None)))
                 for pool, handle in pools]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):  # the replica is gone, and its caches with it
                log.info("cache release for %s failed: %s", request_id, type(r).__name__)
