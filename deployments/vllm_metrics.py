"""The app's figures under vLLM's names on the ingress's own /metrics (VLLMMetrics), summed over the
app's replicas by one small Ray actor (MetricTotals, totals_actor), with the model replicas' gauges
(GaugeReport). Ray's own export of the project's metrics is deployments/metrics.py."""

import asyncio
import logging
import time
import uuid

import prometheus_client

from app.telemetry import STEP_STATES

log = logging.getLogger("ray.serve")

# vLLM's histogram buckets (its v1 metrics: request latency, time to first token, inter-token latency),
# so dashboards and rules written for vLLM read ours at the same bounds
VLLM_REQUEST_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
VLLM_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# name: (buckets, help), each a vLLM histogram of the same name
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": (VLLM_TTFT_S, "Histogram of time to first token in seconds."),
    "inter_token_latency_seconds": (VLLM_ITL_S, "Histogram of inter-token latency in seconds (one observation "
                                                "per round's tokens, as vLLM observes one per engine step)."),
    "request_time_per_output_token_seconds": (VLLM_ITL_S, "Histogram of time_per_output_token_seconds per request."),
    "e2e_request_latency_seconds": (VLLM_REQUEST_S, "Histogram of e2e request latency in seconds."),
    "request_queue_time_seconds": (VLLM_REQUEST_S, "Histogram of time from a request's arrival to its prompt's "
                                                   "forward on a target replica (time to first token less that forward)."),
}
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's request_success labels we produce
GAUGE_TTL_S = 60.0  # a replica's gauges not refreshed for this long are its last words: dropped
HEARTBEAT_S = 15.0  # each replica refreshes its gauges at least this often while it lives


def _zero() -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}


def _add(counts: dict, delta: dict) -> dict:
    """counts += delta, key by key: numbers add, lists add elementwise (growing as needed), dicts recurse.
    Every count only grows, so totals summed in any order are the same."""
    for key, value in delta.items():
        if isinstance(value, dict):
            _add(counts.setdefault(key, {}), value)
        elif isinstance(value, list):
            have = counts.setdefault(key, [])
            have += [0] * (len(value) - len(have))
            for j, n in enumerate(value):
                have[j] += n
        else:
            counts[key] = counts.get(key, 0) + value
    return counts


def observation(buckets: tuple, value: float) -> list:
    """One observation as a histogram delta: [count per bucket (le bounds, then +Inf)..., sum]."""
    row = [0] * (len(buckets) + 2)
    row[next((j for j, b in enumerate(buckets) if value <= b), len(buckets))] = 1
    row[-1] = value
    return row


class MetricTotals:
    """The app's vLLM-named figures, summed over every ingress replica: one small Ray actor
    (`totals_actor`) the replicas add their counts to, so that /metrics gives the same totals whichever
    replica a scrape reaches (per-replica counters jumped between series). Counts only grow. Gauges
    are each replica's latest values (ingress: requests running and waiting; target: KV usage),
    summed over the replicas heard from within GAUGE_TTL_S."""

    def __init__(self, clock=time.monotonic):
        self.totals = _zero()
        self.gauges: dict[str, tuple[float, dict]] = {}
        self.clock = clock

    def add(self, delta: dict, gauges: dict | None = None, source: str | None = None) -> dict:
        """Add a replica's counts (and set its gauges); returns the totals, gauges summed under "gauges"."""
        _add(self.totals, delta)
        if gauges is not None and source is not None:
            self.gauges[source] = (self.clock(), dict(gauges))
        return {**self.totals, "gauges": self.summed_gauges()}

    def summed_gauges(self) -> dict:
        now = self.clock()
        self.gauges = {s: (t, g) for s, (t, g) in self.gauges.items() if now - t <= GAUGE_TTL_S}
        return _sum(g for _, g in self.gauges.values())


def _sum(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        _add(out, d)
    return out


TOTALS_NAMESPACE = "specserve"


def totals_actor_name(app_name: str) -> str:
    """The name of application `app_name`'s MetricTotals actor (in TOTALS_NAMESPACE)."""
    return f"specserve-spec-decode-totals-{app_name}"


def totals_actor(app_name: str):
    """The app's MetricTotals actor, made by the first replica that asks (detached: it outlives any one
    replica, so the totals do too)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1)(MetricTotals)
    return cls.options(name=totals_actor_name(app_name), namespace=TOTALS_NAMESPACE,
                       get_if_exists=True, lifetime="detached").remote()


class GaugeReport:
    """One replica's gauges, sent to the app's totals (`send(gauges)`, async) when they change, at most
    every `every_s`, and every HEARTBEAT_S while the replica lives (so a dead replica's values age out
    and a live one's do not). Set from the replica's event loop; off a loop (tests) nothing is sent."""

    def __init__(self, send, every_s: float = 1.0, sleep=None):
        self.send, self.every_s = send, every_s
        self.sleep = sleep or asyncio.sleep
        self.values: dict = {}
        self.changed = False
        self._task = None

    def set(self, **values) -> None:
        if values != self.values:
            self.values, self.changed = {**self.values, **values}, True
        if self._task is None:
            try:
                self._task = asyncio.get_running_loop().create_task(self._run())
            except RuntimeError:
                pass

    async def _run(self) -> None:
        idle = 0.0
        while True:
            await self.sleep(self.every_s)
            idle += self.every_s
            if self.changed or idle >= HEARTBEAT_S:
                self.changed, idle = False, 0.0
                try:
                    await asyncio.wait_for(self.send(dict(self.values)), 5.0)
                except Exception as e:  # sent again with the next change or heartbeat
                    self.changed = True
                    log.debug("gauges not sent (%s)", type(e).__name__)


class VLLMMetrics:
    """vLLM's serving metrics under vLLM's names, on the ingress's own /metrics, so dashboards, KEDA
    rules, gateways' endpoint pickers and `vllm bench serve` written for vLLM read ours: the
    spec-decode counters, prompt and generation tokens, request_success by finished_reason, the
    TTFT / inter-token / per-request TPOT / e2e / queue-time histograms (vLLM's buckets), requests
    running and waiting, and KV-cache usage. Ray exports the project's own metrics on its own port
    under its own names (above). These are counted by the ingress replicas over the generations they
    ran, summed across them by `totals` (an async add(delta, gauges, source) -> totals: the app's
    MetricTotals actor), flushed at most every `flush_s` and before a scrape. Without totals, or when
    they cannot be reached, a scrape shows this replica's own figures.

    A generation is `waiting` from its arrival until its first token, then `running` until its last
    (vLLM's waiting excludes a prompt being prefilled; ours includes it: the ingress cannot see when a
    prefill forward starts)."""

    def __init__(self, model_name: str, totals=None, flush_s: float = 1.0, source: str | None = None):
        self.model, self.add_to_totals, self.flush_s = model_name, totals, flush_s
        self.source = source or uuid.uuid4().hex  # this replica, among those adding to the totals
        self.own = _zero()  # this replica's, all time
        self.pending = _zero()  # not yet in the totals
        self.totals: dict | None = None  # the app's, as last read
        self.gauges = {"running": 0, "waiting": 0}  # this replica's generations now
        self._flush_task = None

    # -- what the dispatcher reports of each generation --------------------------------------
    def arrived(self) -> None:
        self.gauges["waiting"] += 1

    def first_token(self, ttft_s: float) -> None:
        self.gauges["waiting"] -= 1
        self.gauges["running"] += 1
        self._count({"hist": {"time_to_first_token_seconds": observation(VLLM_TTFT_S, ttft_s)}})

    def between_tokens(self, seconds: float) -> None:
        self._count({"hist": {"inter_token_latency_seconds": observation(VLLM_ITL_S, seconds)}})

    def finished(self, *, started: bool, reason: str, prompt_tokens: int, generated: int, e2e_s: float,
                 ttft_s: float | None, prompt_forward_s: float | None, speculation: dict | None) -> None:
        """A generation ended: `reason` one of FINISH_REASONS; `started`: whether it had its first token."""
        self.gauges["running" if started else "waiting"] -= 1
        hist = {"e2e_request_latency_seconds": observation(VLLM_REQUEST_S, e2e_s)}
        if ttft_s is not None and generated > 1:
            hist["request_time_per_output_token_seconds"] = observation(VLLM_ITL_S, (e2e_s - ttft_s) / (generated - 1))
        if ttft_s is not None and prompt_forward_s is not None:
            hist["request_queue_time_seconds"] = observation(VLLM_REQUEST_S, max(0.0, ttft_s - prompt_forward_s))
        delta = {"prompt_tokens": prompt_tokens, "generation_tokens": generated, "success": {reason: 1}, "hist": hist}
        if speculation is not None:
            delta.update({"drafts": speculation["drafted_rounds"], "draft_tokens": speculation["drafted_tokens"],
                          "accepted": speculation["accepted_tokens"],
                          "per_pos": list(speculation["accepted_per_position"])})
        self._count(delta)

    def _count(self, delta: dict) -> None:
        _add(self.own, delta)
        _add(self.pending, delta)
        if self.add_to_totals is not None and self._flush_task is None:
            try:
                self._flush_task = asyncio.get_running_loop().create_task(self._flush_later())
            except RuntimeError:  # counted off an event loop (a test): flushed by the next render
                pass

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(self.flush_s)
            await self.flush()
        finally:
            self._flush_task = None

    async def flush(self) -> None:
        """Send what this replica counted since the last flush, and its gauges; read the app's totals back."""
        delta, self.pending = self.pending, _zero()
        try:
            self.totals = dict(await asyncio.wait_for(self.add_to_totals(delta, dict(self.gauges), self.source), 5.0))
        except Exception as e:  # the counts stay pending for the next flush
            _add(self.pending, delta)
            log.warning("metric totals unreachable (%s): /metrics shows this replica's figures", type(e).__name__)
            self.totals = None

    async def render(self) -> bytes:
        if self.add_to_totals is not None:
            await self.flush()
        counts = self.totals if self.totals is not None else {**self.own, "gauges": dict(self.gauges)}
        registry = prometheus_client.CollectorRegistry()
        registry.register(_Counts(self.model, counts))
        return prometheus_client.generate_latest(registry)


class _Counts:
    """The app's figures as Prometheus families, with no creation time (these are totals of the app,
    not of a process: a time that changed with the answering replica would read as a reset)."""

    def __init__(self, model: str, counts: dict):
        self.model, self.counts = model, counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        counts, model = self.counts, [self.model]
        for key, name, doc in (("drafts", "spec_decode_num_drafts", "Rounds in which the draft proposed tokens."),
                               ("draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens checked by the target."),
                               ("accepted", "spec_decode_num_accepted_tokens", "Draft tokens the target accepted."),
                               ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
                               ("generation_tokens", "generation_tokens", "Number of generation tokens processed.")):
            family = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric(model, counts.get(key, 0))
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by proposal position.", labels=["model_name", "position"])
        for j, n in enumerate(counts["per_pos"]):
            per_pos.add_metric([self.model, str(j)], n)
        yield per_pos
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([self.model, reason], counts.get("success", {}).get(reason, 0))
        yield success
        gauges = counts.get("gauges", {})
        for key, name, doc in (("running", "num_requests_running", "Number of requests generating tokens."),
                               ("waiting", "num_requests_waiting", "Number of requests waiting for their first token.")):
            family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric(model, max(0, gauges.get(key, 0)))
            yield family
        steps = GaugeMetricFamily("specserve:replica_steps", "Model replicas by what their forwards run on (compiling, "
                                  "compiled, eager, failed: a build that failed twice or failed its check).",
                                  labels=["model_name", "server", "state"])
        for server in ("target", "draft"):
            for state in STEP_STATES:
                steps.add_metric([self.model, server, state], gauges.get("steps", {}).get(server, {}).get(state, 0))
        yield steps
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                               "(the mean over target replicas).", labels=["model_name"])
        kv.add_metric(model, gauges["kv_usage"] / gauges["kv_replicas"] if gauges.get("kv_replicas") else 0.0)
        yield kv
        for name, (buckets, doc) in VLLM_HISTOGRAMS.items():
            row = counts.get("hist", {}).get(name) or [0] * (len(buckets) + 2)
            cumulative, running = [], 0
            for bound, n in zip([*map(str, buckets), "+Inf"], row[:-1]):
                running += n
                cumulative.append((bound, running))
            family = HistogramMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric(model, cumulative, sum_value=row[-1])
            yield family
