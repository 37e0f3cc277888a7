"""The Prometheus metrics of specserve, as Ray Serve metric objects (exported by Ray's metrics agent).

Ray prefixes every name with `ray_`, counters end in `_total` and histograms export
`_bucket/_sum/_count`; Serve adds the `deployment`, `replica` and `application` labels. No label
ever names a request: cardinality stays bounded by replicas, K positions and fallback reasons.
"""

import asyncio
import logging

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


def _zero() -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}


def _add(counts: dict, delta: dict) -> dict:
    """counts += delta (spec-decode counts: three numbers and one per proposal position)."""
    for key in ("drafts", "draft_tokens", "accepted"):
        counts[key] += delta[key]
    per_pos = counts["per_pos"]
    per_pos += [0] * (len(delta["per_pos"]) - len(per_pos))
    for j, n in enumerate(delta["per_pos"]):
        per_pos[j] += n
    return counts


class SpecDecodeTotals:
    """vLLM's spec-decode counts summed over every ingress replica of an app: one small Ray actor
    (`totals_actor`) that the replicas add their counts to, so that /metrics gives the same totals
    whichever replica a scrape reaches (per-replica counters jumped between series). Counts only grow."""

    def __init__(self):
        self.totals = _zero()

    def add(self, delta: dict) -> dict:
        return _add(self.totals, delta)


def totals_actor(app_name: str):
    """The app's SpecDecodeTotals actor, made by the first ingress replica that asks (detached: it
    outlives any one replica, so the totals do too)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1)(SpecDecodeTotals)
    return cls.options(name=f"specserve-spec-decode-totals-{app_name}", namespace="specserve",
                       get_if_exists=True, lifetime="detached").remote()


class VLLMSpecDecodeCounters:
    """vLLM's speculative-decoding counters (`vllm:spec_decode_*_total`) on the ingress's own
    /metrics, so tools written for vLLM (its `vllm bench serve`) report our acceptance. Ray exports
    metrics on its own port under its own names (above); these are counted by the ingress replicas
    over the generations they finished, summed across them by `totals` (an async add(delta) ->
    totals: the app's SpecDecodeTotals actor), flushed at most every `flush_s` and before a scrape.
    Without totals, or when they cannot be reached, a scrape shows this replica's own counts."""

    def __init__(self, model_name: str, totals=None, flush_s: float = 1.0):
        self.model, self.add_to_totals, self.flush_s = model_name, totals, flush_s
        self.own = _zero()  # this replica's, all time
        self.pending = _zero()  # not yet in the totals
        self.totals: dict | None = None  # the app's, as last read
        self._flush_task = None

    def count(self, speculation: dict) -> None:
        """Add one finished generation's `speculation` summary."""
        delta = {"drafts": speculation["drafted_rounds"], "draft_tokens": speculation["drafted_tokens"],
                 "accepted": speculation["accepted_tokens"], "per_pos": list(speculation["accepted_per_position"])}
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
        """Send what this replica counted since the last flush; read the app's totals back."""
        delta, self.pending = self.pending, _zero()
        try:
            self.totals = dict(await asyncio.wait_for(self.add_to_totals(delta), 5.0))
        except Exception as e:  # the counts stay pending for the next flush
            _add(self.pending, delta)
            log.warning("spec-decode totals unreachable (%s): /metrics shows this replica's counts", type(e).__name__)
            self.totals = None

    async def render(self) -> bytes:
        if self.add_to_totals is not None:
            await self.flush()
        counts = self.totals if self.totals is not None else self.own
        registry = prometheus_client.CollectorRegistry()
        registry.register(_Counts(self.model, counts))
        return prometheus_client.generate_latest(registry)


class _Counts:
    """Spec-decode counts as Prometheus counters, with no creation time (these are totals of the app,
    not of a process: a time that changed with the answering replica would read as a reset)."""

    def __init__(self, model: str, counts: dict):
        self.model, self.counts = model, counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for key, name, doc in (("drafts", "num_drafts", "Rounds in which the draft proposed tokens."),
                               ("draft_tokens", "num_draft_tokens", "Draft tokens checked by the target."),
                               ("accepted", "num_accepted_tokens", "Draft tokens the target accepted.")):
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"])
            family.add_metric([self.model], self.counts[key])
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by proposal position.", labels=["model_name", "position"])
        for j, n in enumerate(self.counts["per_pos"]):
            per_pos.add_metric([self.model, str(j)], n)
        yield per_pos
