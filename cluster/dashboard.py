"""The Grafana dashboard (k8s/grafana-dashboard.json, written by `python -m cluster.k8s`): the
speculation and scaling metrics Ray exports (`ray_specserve_*`) and the app's vLLM-named ones."""

# Prometheus names of the speculation metrics: Ray prefixes custom metrics with `ray_`; counters
# end in _total; histograms export _bucket/_sum/_count.
COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_emitted_tokens", "rounds", "fallback_rounds"]
HISTOGRAMS = ["round_latency_seconds", "draft_propose_latency_seconds", "target_verify_latency_seconds",
              "batch_size", "k_chosen"]
GAUGES = ["kv_cache_bytes", "active_requests"]
SEL = '{ray_io_cluster=~"$cluster"}'
RATE = "[$__rate_interval]"


def m(name: str, suffix: str = "") -> str:
    """The exported name of a specserve metric with the dashboard's cluster filter."""
    return f"ray_specserve_{name}{suffix}{SEL}"


def rate(name: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({m(name, '_total')}{RATE}))"


def quantile(q: float, name: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''})(rate({m(name, '_bucket')}{RATE})))"


def mean(name: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({m(name, '_sum')}{RATE})) / sum{group}(rate({m(name, '_count')}{RATE}))"


# vLLM's names, from the app's /metrics (k8s/monitoring.yaml's second PodMonitor; deployments/vllm_metrics.py)
VLLM_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]
VLLM_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]


def v(name: str, suffix: str = "") -> str:
    return f"vllm:{name}{suffix}{SEL}"


def vquantile(q: float, name: str) -> str:
    return f"histogram_quantile({q}, sum by (le)(rate({v(name, '_bucket')}{RATE})))"


def panel(title: str, unit: str, targets: list[tuple[str, str]], desc: str) -> dict:
    return {"type": "timeseries", "title": title, "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(targets)]}


def panels() -> list[dict]:
    """Speculation's panels, then serving's."""
    return speculation_panels() + serving_panels()


def speculation_panels() -> list[dict]:
    return [
        panel("Acceptance rate", "percentunit", [
            (f"{rate('spec_decode_num_accepted_tokens')} / {rate('spec_decode_num_draft_tokens')}", "accepted / drafted")],
            "Share of draft tokens the target accepted (alpha)."),
        panel("Tokens per second", "short", [
            (rate("spec_decode_num_emitted_tokens"), "emitted"),
            (rate("spec_decode_num_accepted_tokens"), "accepted draft tokens")],
            "Tokens streamed to clients; accepted draft tokens are the ones speculation saved a target step on."),
        panel("Tokens per round", "short", [
            (f"{rate('spec_decode_num_emitted_tokens')} / {rate('rounds')}", "emitted / round"),
            (f"{rate('spec_decode_num_accepted_tokens')} / {rate('spec_decode_num_drafts')}", "accepted / draft"),
            (mean("k_chosen"), "mean K chosen")],
            "Mean accepted length (1 = no gain) against the K the controller chose."),
        panel("Round latency: draft vs verify (p50, p95)", "s", [
            (quantile(0.5, "round_latency_seconds"), "round p50"),
            (quantile(0.95, "round_latency_seconds"), "round p95"),
            (quantile(0.95, "draft_propose_latency_seconds"), "draft propose p95"),
            (quantile(0.95, "target_verify_latency_seconds"), "target verify p95")],
            "A round = one draft proposal + one batched target verification."),
        panel("Batch size per deployment", "short", [
            (mean("batch_size", "deployment"), "{{deployment}} mean"),
            (quantile(0.95, "batch_size", "deployment"), "{{deployment}} p95")],
            "Calls fused into one forward by @serve.batch, DraftServer and TargetServer."),
        panel("Fallback rounds (plain target steps)", "ops", [
            (rate("fallback_rounds", "reason"), "{{reason}}"),
            (f"{rate('fallback_rounds')} / {rate('rounds')}", "share of rounds")],
            "Rounds run without the draft: unavailable, too slow, or acceptance too low to pay."),
    ]


def serving_panels() -> list[dict]:
    serve = '{ray_io_cluster=~"$cluster", application="specserve"}'
    return [
        panel("Healthy replicas per deployment", "short", [
            (f"sum by (deployment)(ray_serve_deployment_replica_healthy{serve})", "{{deployment}}")],
            "Serve replicas; DraftServer and TargetServer autoscale independently."),
        panel("Ray worker pods per group", "short", [
            (f"count by (ray_io_group)(ray_node_cpu_count{SEL})", "{{ray_io_group}}")],
            "Pods of each KubeRay worker group: the draft and target pools scaling."),
        panel("Active requests and KV cache", "short", [
            (f"sum({m('active_requests')})", "active requests"),
            (f"sum by (ray_io_group)({m('kv_cache_bytes')}) / 2^30", "KV cache GiB {{ray_io_group}}")],
            "Requests in flight in the ingress; KV cache held by the replicas of each pool."),
        panel("Time to first token (p50, p95)", "s", [
            (vquantile(0.5, "time_to_first_token_seconds"), "TTFT p50"),
            (vquantile(0.95, "time_to_first_token_seconds"), "TTFT p95"),
            (vquantile(0.95, "request_queue_time_seconds"), "queue time p95")],
            "From a request's arrival to its first token; queue time is the part before its prompt's forward."),
        panel("Time per output token (p50, p95)", "s", [
            (vquantile(0.5, "request_time_per_output_token_seconds"), "TPOT p50"),
            (vquantile(0.95, "request_time_per_output_token_seconds"), "TPOT p95"),
            (vquantile(0.95, "inter_token_latency_seconds"), "between rounds p95")],
            "Per request, after the first token; a speculative round delivers several tokens at once."),
        panel("End-to-end request latency (p50, p95)", "s", [
            (vquantile(0.5, "e2e_request_latency_seconds"), "p50"),
            (vquantile(0.95, "e2e_request_latency_seconds"), "p95")],
            "From arrival at the ingress to the last token."),
        panel("Requests running and waiting; KV cache usage", "short", [
            (f"sum({v('num_requests_running')})", "running"),
            (f"sum({v('num_requests_waiting')})", "waiting (before the first token)"),
            (f"max({v('kv_cache_usage_perc')})", "KV cache usage (fraction, mean over target replicas)")],
            "Queue depth and KV pressure under vLLM's names, as KEDA rules and gateways read them."),
        panel("HTTP errors", "reqps", [
            (f"sum by (route, error_code)(rate(ray_serve_num_http_error_requests_total{serve}{RATE}))",
             "{{route}} {{error_code}}")],
            "Error responses of the Serve proxies by route and status code."),
    ]


def dashboard() -> dict:
    """The Grafana dashboard (JSON model) of the speculation and scaling metrics."""
    ps = panels()
    for i, p in enumerate(ps):
        p["id"] = i + 1
        p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {"name": "cluster", "type": "query", "label": "Ray cluster", "includeAll": True, "multi": True,
         "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
         "query": "label_values(ray_serve_deployment_replica_healthy, ray_io_cluster)"},
    ]
    return {"title": "specserve: speculative decoding", "uid": "specserve-spec", "tags": ["specserve", "ray"],
            "schemaVersion": 39, "version": 1, "editable": True, "time": {"from": "now-1h", "to": "now"},
            "refresh": "30s", "templating": {"list": variables}, "panels": ps}
