"""The Prometheus metrics of specserve, as Ray Serve metric objects (exported by Ray's metrics agent).

Ray prefixes every name with `ray_`, counters end in `_total` and histograms export
`_bucket/_sum/_count`; Serve adds the `deployment`, `replica` and `application` labels. No label
ever names a request: cardinality stays bounded by replicas, K positions and fallback reasons.
"""

import asyncio
import logging
import time
import uuid

import prometheus_client
from ray.serve.metrics import Counter, Gauge, Histogram

from app.telemetry import RoundFacts

log = logging.getLogger("ray.serve")

LATENCY_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TTFT_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256]
K = [0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]  # 0.5: the bucket of K = 0 (bounds must be > 0)


def _name(short: str) -> str:
    return f"specserve_{short}"


class RoundMetrics:
    """Per-round counters and latencies of one TargetServer replica (where rounds run)."""

    def __init__(self):
        c = lambda n, d, tags=(): Counter(_name(n), d, tag_keys=tags)  # noqa: E731
        h = lambda n, d, b, tags=(): Histogram(_name(n), d, boundaries=b, tag_keys=tags)  # noqa: E731
        self.drafts = c("spec_decode_num_drafts", "Rounds in which the draft proposed tokens.")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens checked by the target.")
        self.accepted = c("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted draft tokens by position in the proposal (0 = first).", ("position",))
        self.emitted = c("spec_decode_num_emitted_tokens", "Tokens produced by rounds (accepted + recovered/bonus).")
        self.rounds = c("rounds", "Rounds: one target verification each.")
        self.fallback_rounds = c("fallback_rounds", "Rounds run as plain target steps, by reason.", ("reason",))
        self.ahead = c("draft_ahead_rounds", "Rounds that found a proposal drafted ahead, by outcome (hit, miss).",
                       ("outcome",))
        self.hidden = h("draft_hidden_seconds", "Draft round trip hidden behind the previous verify, per hit.",
                        LATENCY_S)
        self.round_latency = h("round_latency_seconds", "One round: propose + verify, as the target replica sees it.",
                               LATENCY_S)
        self.propose_latency = h("draft_propose_latency_seconds",
                                 "Waiting for the draft's proposal in a round (near 0 when drafted ahead).", LATENCY_S)
        self.verify_latency = h("target_verify_latency_seconds", "A round's verify, queueing included.", LATENCY_S)
        self.queue = h("batch_queue_seconds",
                       "Round trip minus the batch forward: waiting for the model (and the hop to the draft pool).",
                       LATENCY_S, ("server",))
        self.k_chosen = h("k_chosen", "K of each round (0 = plain target step).", K)
        self.accepted_length = h("accepted_length", "Tokens emitted per round (tau; 1 = no gain).", K)

    def request(self) -> "RequestMetrics":
        """The round observer of one request."""
        return RequestMetrics(self)


class RequestMetrics:
    """Sees one request's rounds (app.telemetry.RoundObserver)."""

    def __init__(self, m: RoundMetrics):
        self.m = m

    def round(self, f: RoundFacts) -> None:
        m = self.m
        m.rounds.inc()
        if f.emitted:  # Ray counters refuse increments of 0
            m.emitted.inc(f.emitted)
        m.round_latency.observe(f.round_s)
        m.k_chosen.observe(f.k)
        m.accepted_length.observe(f.emitted)
        m.verify_latency.observe(f.verify_s)
        m.queue.observe(max(0.0, f.verify_s - f.verify_forward_s), {"server": "target"})
        if f.drafted:
            m.drafts.inc()
            m.draft_tokens.inc(f.drafted)
            m.propose_latency.observe(f.draft_s)
            if not f.ahead_hit:
                m.queue.observe(max(0.0, f.draft_s - f.draft_forward_s), {"server": "draft"})
        if f.ahead_hit is not None:
            m.ahead.inc(1, {"outcome": "hit" if f.ahead_hit else "miss"})
            if f.ahead_hit:
                m.hidden.observe(f.draft_hidden_s)
        if f.accepted:
            m.accepted.inc(f.accepted)
        for j in range(f.accepted):
            m.accepted_per_pos.inc(1, {"position": str(j)})
        if f.fallback:
            m.fallback_rounds.inc(1, {"reason": f.fallback})


class DispatchMetrics:
    """Requests in flight, failovers and per-request latencies of one Ingress replica (its Dispatcher)."""

    def __init__(self):
        self.target_retries = Counter(_name("target_retries"), "Requests resumed on another target replica.")
        self.ttft = Histogram(_name("ttft_seconds"), "Time to the first token, from the dispatcher's start of the request.",
                              boundaries=TTFT_S)
        self.tpot = Histogram(_name("tpot_seconds"), "Mean time per output token after the first, per request.",
                              boundaries=LATENCY_S)
        self.active = Gauge(_name("active_requests"), "Requests in flight in this ingress.")
        self.active.set(0)

    def retry(self) -> None:
        self.target_retries.inc()

    def set_active(self, n: int) -> None:
        self.active.set(n)


class ServerMetrics:
    """Batch sizes and KV cache occupancy of one DraftServer or TargetServer replica."""

    def __init__(self):
        self.batch_size = Histogram(_name("batch_size"), "Items (rounds of sequences) in one forward.",
                                    boundaries=BATCH)
        self.kv_bytes = Gauge(_name("kv_cache_bytes"),
                              "KV cache bytes held by this replica (finished sequences kept as prefix donors included).")
        self.kv_sequences = Gauge(_name("kv_cache_sequences"), "Live sequences with a KV cache on this replica.")
        self.prefix_hits = Counter(_name("prefix_cache_hit_tokens"),
                                   "Prompt tokens not computed: copied from another sequence's cached prefix.")
        self._prefix_hits_seen = 0
        self.signals = Gauge(_name("autoscaling_signal"), "The last figures this replica gave its pool's "
                             "autoscaling policy (deployments/autoscaling.py), by signal.", tag_keys=("signal",))

    def signal(self, figures: dict[str, float]) -> dict[str, float]:
        """Export what the replica just reported to Serve's autoscaler; returns it."""
        for name, value in figures.items():
            self.signals.set(value, {"signal": name})
        return figures

    def batch(self, size: int, cache) -> None:
        """After a batch: its size and the cache it left."""
        self.batch_size.observe(size)
        self.cache(cache)

    def cache(self, cache) -> None:
        self.kv_bytes.set(cache.nbytes)
        self.kv_sequences.set(len(cache))
        if cache.prefix_hit_tokens > self._prefix_hits_seen:
            self.prefix_hits.inc(cache.prefix_hit_tokens - self._prefix_hits_seen)
            self._prefix_hits_seen = cache.prefix_hit_tokens


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
