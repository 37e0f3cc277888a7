"""Dispatcher: the control plane of a request, in the ingress. Placement, admission, failover.

The rounds run on the TargetServer replica the request is placed on (Serve's load-aware choice
among the replicas; a full replica refuses, and the request gets a 503). The ingress reads that
replica's stream directly, and the dispatcher keeps the request's job up to date from it: the tokens
and text streamed, and the K controller's state. If the replica dies, the same job goes to another
replica, which continues from the streamed tokens: greedy and seeded output is unchanged and
nothing streamed repeats or goes missing.

It is a plain class the ingress holds, not a deployment of its own: relaying every chunk through a
deployment of its own cost a quarter of a core at 16 streams on a 2-core machine (measured), and the
durable state of a request is what was streamed, which the ingress has.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from app import telemetry
from app.chunks import Chunk
from app.errors import RankFailure
from app.job import GenerationJob
from deployments.args import AppConfig
from deployments.metrics import DispatchMetrics
from deployments.vllm_metrics import VLLMMetrics

log = logging.getLogger("ray.serve")

REPLICA_GONE = (RayActorError, ActorUnavailableError, DeploymentUnavailableError, RankFailure)


def replica_gone(e: BaseException) -> bool:
    """Whether a call failed because its replica (or one of its rank workers) is gone, not the request."""
    return isinstance(e, REPLICA_GONE) or isinstance(getattr(e, "cause", None), REPLICA_GONE)


@contextlib.contextmanager
def own_serve_request():
    """Calls made inside are a Serve request of their own. A handle call inherits its caller's
    internal request id, and Serve tracks calls in flight by that id: the generations of one HTTP
    request (its n choices, its batch of prompts) sharing it jammed the target replica's calls to the
    draft pool (one spun in Serve's request router, measured). Serve offers no public way to set the
    id, so this sets its request-context variable, the way Serve's own proxy does per request."""
    from ray.serve import context

    current = context._get_serve_request_context()
    token = context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


class Dispatcher:
    """One streaming call per request to a target replica; a new one after that replica fails.

    A target pool at its queue limit raises Serve's BackPressureError: the caller answers 503.
    """

    def __init__(self, target, cfg: AppConfig, vllm: VLLMMetrics, sleep=asyncio.sleep, clock=time.perf_counter):
        self.target, self.cfg = target, cfg
        self.sleep, self.clock = sleep, clock  # injected by tests: the retry backoff, the request timings
        self.active = 0
        self.metrics = DispatchMetrics()
        self.vllm = vllm  # the /metrics figures under vLLM's names

    async def generate(self, job: GenerationJob, trace: dict | None = None) -> AsyncIterator[Chunk]:
        """Stream {token_ids, text, controller} per round, then {finish_reason, usage, speculation} (or {error}).

        `job`: the request, its seed chosen (and, when it continues a stream an ingress replica began,
        what that stream had sent: deployments/failover.py). `trace`: the caller's W3C trace context;
        the generation span is its child.
        """
        span = telemetry.start_span("generate", trace, {"specserve.prompt_tokens": len(job.prompt_ids),
                                                        "specserve.max_tokens": job.params.max_tokens})
        job.trace = telemetry.carrier(span)
        self.active += 1
        self.metrics.set_active(self.active)
        self.vllm.arrived()
        began = last = self.clock()
        first, end, resumed_at = None, None, len(job.output_ids)  # a resumed job has output streamed before
        try:
            async for chunk in self._run(job):
                if chunk.get("token_ids"):
                    now = self.clock()
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(first - began)
                        self.vllm.first_token(first - began)
                    else:
                        self.vllm.between_tokens(now - last)
                    last = now
                if "finish_reason" in chunk or chunk.get("error"):
                    end = chunk
                yield chunk
        finally:
            self.active -= 1
            self.metrics.set_active(self.active)
            if first is not None and len(job.output_ids) > 1:
                self.metrics.tpot.observe((self.clock() - first) / (len(job.output_ids) - 1))
            self._finished(job, end, began, first, len(job.output_ids) - resumed_at)
            telemetry.set_attributes(span, {"specserve.completion_tokens": len(job.output_ids)})
            if span is not None:
                span.end()

    def _finished(self, job: GenerationJob, end: Chunk | None, began: float, first: float | None,
                  generated: int) -> None:
        """Report a generation that ended (its last chunk `end`; None: stopped, its client gone)."""
        reason = "abort" if end is None else "error" if end.get("error") else (
            "length" if end["finish_reason"] == "length" else "stop")
        ttft = None if first is None else first - began
        self.vllm.finished(started=first is not None, reason=reason, prompt_tokens=len(job.prompt_ids),
                           generated=generated, e2e_s=self.clock() - began, ttft_s=ttft,
                           prompt_forward_s=(end or {}).get("prompt_forward_s"),
                           speculation=(end or {}).get("speculation"))

    async def _run(self, job: GenerationJob) -> AsyncIterator[Chunk]:
        """The job's chunks from a target replica, resumed on another while replicas fail."""
        retries = self.cfg.limits.target_retries
        for attempt in range(retries + 1):
            with own_serve_request():
                stream = self.target.options(stream=True).generate.remote(job)
            try:
                async for chunk in stream:
                    job.record(chunk)
                    yield chunk
                return
            except Exception as e:
                if not replica_gone(e):
                    raise
                log.warning("target replica failed mid-request (%s), attempt %d; resuming from %d streamed tokens",
                            type(e).__name__, attempt + 1, len(job.output_ids))
                if attempt == retries:
                    yield Chunk(error={"message": f"no target replica could serve the request: {e}",
                                       "type": "service_unavailable", "code": 503})
                    return
                self.metrics.retry()
                await self.sleep(min(0.5 * 2**attempt, 5.0))
            finally:
                stream.cancel()  # a client that went away (or a failed replica) stops the generation
