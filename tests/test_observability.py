"""Metrics and traces of the running app on a local cluster: the Prometheus scrape of every node's
metrics agent agrees with the responses' speculation stats, and a traced request arrives at an OTLP
HTTP receiver on loopback as one span tree across the ingress, target and draft."""

import gzip
import http.server
import json
import re
import threading
import time
import urllib.request
from collections import defaultdict

import httpx
import pytest
import ray
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from cluster import dashboard
from serving import free_port, running_app, save_tiny_pair

pytestmark = pytest.mark.slow
PROMPTS = [f"def g{i}(y):\n    return y" + " * 2" * i for i in range(4)]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class OTLPReceiver(http.server.ThreadingHTTPServer):
    """Collects the spans POSTed to /v1/traces (OTLP/HTTP protobuf)."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []  # (specserve.component of the sender, span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for rs in req.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        receiver.spans += [(attrs.get("specserve.component"), s)
                                           for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: str) -> list:
        with self.lock:
            return [(c, s) for c, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def app(tmp_path_factory, receiver):
    pair = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_SERVICE_NAME": "specserve-test", "NO_PROXY": "127.0.0.1"}
    # two ingress replicas: /metrics must give the app's totals whichever one answers
    with running_app(*pair, env=env, system_config={"metrics_report_interval_ms": 1000},
                     deployments={"Ingress": {"num_replicas": 2}}, compiled=False) as url:
        yield url


def scrape() -> dict[str, list]:
    """Every node's metrics, as name -> [(labels, value)] (Prometheus sample names: _total, _bucket, ...)."""
    out = defaultdict(list)
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_specserve_"):
                    out[s.name].append((s.labels, s.value))
    return out


def total(metrics: dict, name: str, **labels) -> float:
    return sum(v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def complete(app: str, prompt: str, headers: dict | None = None, **extra) -> dict:
    body = {"model": "target", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{app}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


COUNTED = {  # counter -> the response's speculation field it must add up to
    "ray_specserve_spec_decode_num_draft_tokens_total": "drafted_tokens",
    "ray_specserve_spec_decode_num_accepted_tokens_total": "accepted_tokens",
    "ray_specserve_spec_decode_num_accepted_tokens_per_pos_total": "accepted_tokens",
    "ray_specserve_rounds_total": "rounds",
    "ray_specserve_round_latency_seconds_count": "rounds",
    "ray_specserve_k_chosen_count": "rounds",
    "ray_specserve_fallback_rounds_total": "fallback_rounds",
}


def test_counters_add_up_to_the_responses_speculation_stats(app):
    before = scrape()
    specs = [complete(app, p, speculation={"num_tokens": 3})["speculation"] for p in PROMPTS]
    specs.append(complete(app, PROMPTS[0], speculation={"enabled": False})["speculation"])
    want = {name: sum(s[field] for s in specs) for name, field in COUNTED.items()}
    # tau is over decoding rounds; each request's first round (its prompt's prefill) emitted one token
    emitted = round(sum(s["mean_accepted_length"] * (s["rounds"] - 1) + 1 for s in specs))
    deadline, got = time.monotonic() + 90, {}
    # Ray's agents export every metrics_report_interval_ms, each replica's process on its own clock:
    # wait for the target's counters and for the draft replica's batches alike
    while time.monotonic() < deadline:
        after = scrape()
        got = {name: total(after, name) - total(before, name) for name in COUNTED}
        exported = {lab["deployment"] for lab, _ in after.get("ray_specserve_batch_size_count", [])}
        # the ingress's gauge is exported on its own clock too: the last response may reach us first
        idle = total(after, "ray_specserve_active_requests", deployment="Ingress") == 0
        if got == want and exported == {"DraftServer", "TargetServer"} and idle:
            break
        time.sleep(1)
    assert got == want
    assert total(after, "ray_specserve_spec_decode_num_emitted_tokens_total") \
        - total(before, "ray_specserve_spec_decode_num_emitted_tokens_total") == emitted
    drafting_rounds = total(after, "ray_specserve_spec_decode_num_drafts_total") \
        - total(before, "ray_specserve_spec_decode_num_drafts_total")
    assert 0 < drafting_rounds <= want["ray_specserve_rounds_total"]
    # per position: position 0 was accepted at least as often as any later one
    per_pos = {lab["position"]: v for lab, v in after["ray_specserve_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos["0"] == max(per_pos.values())
    # batch sizes by deployment, cache gauges per server replica, requests in flight per ingress
    sizes = {lab["deployment"] for lab, _ in after["ray_specserve_batch_size_count"]}
    assert sizes == {"DraftServer", "TargetServer"}
    assert {lab["deployment"] for lab, _ in after["ray_specserve_kv_cache_sequences"]} == sizes
    assert total(after, "ray_specserve_active_requests", deployment="Ingress") == 0
    assert all("request" not in k for samples in after.values() for lab, _ in samples for k in lab)


def test_the_dashboard_queries_names_ray_exports(app):
    complete(app, PROMPTS[1], speculation={"num_tokens": 2})
    used = set(re.findall(r"\bray_specserve_\w+", json.dumps(dashboard.dashboard())))
    wanted = used - {"ray_specserve_fallback_rounds_total"}  # exported once a round falls back
    deadline, missing = time.monotonic() + 60, wanted
    while time.monotonic() < deadline and missing:
        missing = wanted - set(scrape())
        time.sleep(1)
    assert not missing


def test_a_request_is_one_trace_across_the_deployments(app, receiver):
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    spec = complete(app, PROMPTS[2], headers={"traceparent": traceparent}, speculation={"num_tokens": 3})["speculation"]
    expected = {"POST /v1/completions": 1, "generate": 1, "TargetServer.generate": 1, "round": spec["rounds"],
                "target.verify": spec["rounds"], "TargetServer.verify": spec["rounds"]}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spans = receiver.of_trace(TRACE_ID)
        counts = defaultdict(int)
        for _, s in spans:
            counts[s.name] += 1
        if all(counts[n] >= c for n, c in expected.items()) and counts["DraftServer.propose"] >= 1:
            break
        time.sleep(0.5)
    by_id = {s.span_id.hex(): (c, s) for c, s in spans}
    # the rounds run on the target replica; a proposal drafted ahead is a child of the round it overlapped
    parents = {"POST /v1/completions": None, "generate": "POST /v1/completions", "TargetServer.generate": "generate",
               "round": "TargetServer.generate", "draft.propose": "round", "target.verify": "round",
               "DraftServer.propose": "draft.propose", "TargetServer.verify": "target.verify",
               "draft.beside_prefill": "TargetServer.generate"}
    components = {"POST /v1/completions": "ingress", "generate": "ingress", "TargetServer.generate": "TargetServer",
                  "round": "TargetServer", "DraftServer.propose": "DraftServer", "TargetServer.verify": "TargetServer"}
    for component, s in spans:
        parent = s.parent_span_id.hex()
        if parents[s.name] is None:
            assert parent == CLIENT_SPAN  # the client's traceparent header
        else:
            # the prompt's proposal is asked beside its prefill, before the first round
            allowed = {parents[s.name]} | ({"draft.beside_prefill"} if s.name == "draft.propose" else set()) | (
                {"round"} if s.name == "draft.beside_prefill" else set())  # a short prompt's: in its first round
            assert by_id[parent][1].name in allowed, s.name
        assert component == components.get(s.name, component)
    for n, c in expected.items():
        assert counts[n] == c, n
    rounds = [s for _, s in spans if s.name == "round"]
    attrs = lambda s: {a.key: a.value for a in s.attributes}  # noqa: E731
    assert sum(attrs(s)["specserve.accepted"].int_value for s in rounds) == spec["accepted_tokens"]
    servers = [s for _, s in spans if s.name.endswith(("Server.propose", "Server.verify"))]
    assert all(attrs(s)["specserve.replica"].string_value and attrs(s)["specserve.batch_size"].int_value >= 1
               for s in servers)


def vllm_totals(app: str) -> dict[str, float]:
    """The /metrics lines `vllm bench serve` sums: vllm:spec_decode_*_total, per position included."""
    text = httpx.get(f"{app}/metrics", timeout=30).text
    return {line.rsplit(None, 1)[0]: float(line.rsplit(None, 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode") and line.split("{")[0].endswith("_total")}


def test_vllm_counters_are_the_apps_whichever_ingress_replica_answers(app):
    """Two ingress replicas each count the generations they finish; /metrics serves their sum from
    either (before, each scrape got the answering replica's own counters, and rates jumped)."""
    name = 'vllm:spec_decode_num_drafts_total{model_name="target"}'
    before = vllm_totals(app)
    specs = [complete(app, p, speculation={"num_tokens": 3})["speculation"] for p in PROMPTS * 3]
    want = before.get(name, 0.0) + sum(s["drafted_rounds"] for s in specs)
    deadline, got = time.monotonic() + 30, None
    while time.monotonic() < deadline:  # each replica flushes within a second; a scrape, the answering one at once
        got = vllm_totals(app)
        if got.get(name) == want:
            break
        time.sleep(0.5)
    assert got.get(name) == want
    scrapes = [vllm_totals(app) for _ in range(10)]
    assert all(s == got for s in scrapes)


def vllm_families(app: str) -> dict:
    """/metrics as vLLM's families: name -> (type, {(label pairs): value} of its samples)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{app}/metrics", timeout=30).text):
        if family.name.startswith("vllm:"):
            out[family.name] = (family.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                              for s in family.samples})
    return out


def test_vllms_serving_metrics_sum_the_apps_responses(app):
    """After known traffic through two ingress replicas, /metrics has vLLM's serving series under its
    names, types and labels, and their counts grow by what the responses say."""
    model = (("model_name", "target"),)

    def value(families, name, sample, **labels):
        return families[name][1].get((sample, tuple(sorted({**dict(model), **labels}.items()))), 0.0)

    before = vllm_families(app)
    types = {"vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
             "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram",
             "vllm:request_time_per_output_token_seconds": "histogram"}
    assert {n: before[n][0] for n in types} == types
    bodies = [complete(app, p, max_tokens=6 + i) for i, p in enumerate(PROMPTS * 2)]
    usage = [b["usage"] for b in bodies]
    want = {("vllm:prompt_tokens", "vllm:prompt_tokens_total"): sum(u["prompt_tokens"] for u in usage),
            ("vllm:generation_tokens", "vllm:generation_tokens_total"): sum(u["completion_tokens"] for u in usage)}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds"):
        want[(f"vllm:{name}", f"vllm:{name}_count")] = len(bodies)
    deadline, grew = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # each replica flushes within a second
        after = vllm_families(app)
        grew = {key: value(after, *key) - value(before, *key) for key in want}
        length = value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length") \
            - value(before, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        if grew == want and length == len(bodies):
            break
        time.sleep(0.5)
    assert grew == want and length == len(bodies)
    # every generation waited, then ran, then ended: no request is left counted in either gauge
    assert value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1.0
    # an inter-token observation per round after the first token: at least one per request here
    itl = "vllm:inter_token_latency_seconds"
    assert value(after, itl, f"{itl}_count") - value(before, itl, f"{itl}_count") >= len(bodies)
    ttft = "vllm:time_to_first_token_seconds"
    assert value(after, ttft, f"{ttft}_bucket", le="+Inf") == value(after, ttft, f"{ttft}_count")
    assert {dict(k[1]).get("le") for k in after[ttft][1] if k[0] == f"{ttft}_bucket"} >= {"0.001", "2560.0", "+Inf"}
