"""The Prometheus metrics of specserve, as Ray Serve metric objects (exported by Ray's metrics agent;
the vLLM-named figures of the ingress's own /metrics are deployments/vllm_metrics.py).

Ray prefixes every name with `ray_`, counters end in `_total` and histograms export
`_bucket/_sum/_count`; Serve adds the `deployment`, `replica` and `application` labels. No label
ever names a request: cardinality stays bounded by replicas, K positions and fallback reasons.
"""

import logging

from ray.serve.metrics import Counter, Gauge, Histogram

from app.telemetry import STEP_STATES, RoundFacts

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
        self.step_state = Gauge(_name("steps"), "What this replica's forwards run on, by state: 1 for the one it is "
                                "in (compiling: built in the background, forwards eager meanwhile; compiled; eager: "
                                "compile off or impossible; failed: a build failed twice, or its steps failed their "
                                "check, forwards eager).", tag_keys=("state",))

    def steps(self, state: str) -> None:
        """The replica's steps are in `state` (one of app.model.runner.STEP_STATES)."""
        for s in STEP_STATES:
            self.step_state.set(1.0 if s == state else 0.0, {"state": s})

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
