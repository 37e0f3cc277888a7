"""vLLM's serving metrics on the ingress's /metrics without a cluster: what a generation adds to them
(a dispatcher over a scripted target stream, its clock injected), their exposition (names, types,
labels, vLLM's buckets), and the app's totals across replicas (gauges summed, aged out)."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from app.job import GenerationJob
from app.params import SamplingParams
from deployments.args import AppConfig
from deployments.dispatch import Dispatcher
from test_dispatch import TargetPool
from deployments.vllm_metrics import (GAUGE_TTL_S, HEARTBEAT_S, VLLM_ITL_S, VLLM_REQUEST_S, VLLM_TTFT_S, GaugeReport,
                                 MetricTotals, VLLMMetrics)

SPEC = {"drafted_rounds": 2, "drafted_tokens": 6, "accepted_tokens": 3, "accepted_per_position": [2, 1]}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Scripted(TargetPool):
    """A target pool whose stream sends `chunks`, moving the clock by each one's `after` seconds first."""

    def __init__(self, clock: Clock, chunks: list[tuple[float, dict]]):
        super().__init__(make_engine=None)
        self.clock, self.chunks = clock, chunks

    async def _replica(self, job):
        for after, chunk in self.chunks:
            self.clock.t += after
            yield chunk


def families(metrics: VLLMMetrics) -> dict:
    text = asyncio.run(metrics.render()).decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    want = {"model_name": "target", **labels}
    return next(s.value for s in fams[family].samples if s.name == name and s.labels == want)


def job(prompt: int = 7, max_tokens: int = 5) -> GenerationJob:
    return GenerationJob.new(list(range(10, 10 + prompt)), SamplingParams(max_tokens=max_tokens, temperature=0), "r1")


def dispatch(chunks: list[tuple[float, dict]], metrics: VLLMMetrics, stop_after: int | None = None) -> None:
    clock = Clock()
    router = Dispatcher(Scripted(clock, chunks), AppConfig(), metrics, clock=clock)

    async def go():
        gen = router.generate(job())
        n = 0
        async for _ in gen:
            n += 1
            if n == stop_after:  # the client went away
                await gen.aclose()
                return
    asyncio.run(go())


def test_a_generation_adds_its_tokens_latencies_and_finish_to_vllms_series():
    metrics = VLLMMetrics("target")
    dispatch([(0.25, {"token_ids": [1], "text": "a"}),  # first token after 250 ms
              (0.04, {"token_ids": [2, 3, 4], "text": "bcd"}),  # a round of three tokens, 40 ms later
              (0.02, {"token_ids": [5], "text": "e"}),
              (0.001, {"token_ids": [], "text": "", "finish_reason": "length", "speculation": SPEC,
                       "usage": {"prompt_tokens": 7, "completion_tokens": 5}, "prompt_forward_s": 0.05})], metrics)
    fams = families(metrics)
    assert sample(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 7
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    assert sample(fams, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 2
    ttft = "vllm:time_to_first_token_seconds"
    assert sample(fams, ttft, f"{ttft}_sum") == 0.25 and sample(fams, ttft, f"{ttft}_count") == 1
    assert sample(fams, ttft, f"{ttft}_bucket", le="0.1") == 0 and sample(fams, ttft, f"{ttft}_bucket", le="0.25") == 1
    itl = "vllm:inter_token_latency_seconds"  # one observation per round after the first token
    assert sample(fams, itl, f"{itl}_count") == 2 and abs(sample(fams, itl, f"{itl}_sum") - 0.06) < 1e-9
    e2e = "vllm:e2e_request_latency_seconds"
    assert abs(sample(fams, e2e, f"{e2e}_sum") - 0.311) < 1e-9
    queue = "vllm:request_queue_time_seconds"  # TTFT less the prompt's forward
    assert abs(sample(fams, queue, f"{queue}_sum") - 0.2) < 1e-9
    tpot = "vllm:request_time_per_output_token_seconds"  # (e2e - ttft) / (tokens - 1)
    assert abs(sample(fams, tpot, f"{tpot}_sum") - 0.061 / 4) < 1e-9
    assert sample(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert sample(fams, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0


def test_a_client_gone_counts_as_aborted_and_an_error_as_error():
    metrics = VLLMMetrics("target")
    dispatch([(0.1, {"token_ids": [1], "text": "a"}), (0.1, {"token_ids": [2], "text": "b"})], metrics, stop_after=1)
    dispatch([(0.1, {"error": {"message": "no replica", "type": "service_unavailable", "code": 503}})], metrics)
    fams = families(metrics)
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="error") == 1
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 1
    assert metrics.gauges == {"running": 0, "waiting": 0}


def test_requests_are_waiting_until_their_first_token_then_running():
    metrics = VLLMMetrics("target")
    seen = []

    class Watch(Scripted):
        async def _replica(self, job):
            seen.append(dict(metrics.gauges))
            yield {"token_ids": [1], "text": "a"}
            seen.append(dict(metrics.gauges))
            yield {"token_ids": [], "text": "", "finish_reason": "stop", "speculation": SPEC}

    clock = Clock()
    router = Dispatcher(Watch(clock, []), AppConfig(), metrics, clock=clock)

    async def go():
        async for _ in router.generate(job()):
            pass
    asyncio.run(go())
    assert seen == [{"running": 0, "waiting": 1}, {"running": 1, "waiting": 0}]
    assert metrics.gauges == {"running": 0, "waiting": 0}


def test_the_exposition_has_vllms_types_and_buckets():
    fams = families(VLLMMetrics("target"))
    kinds = {name: f.type for name, f in fams.items()}
    assert kinds["vllm:num_requests_running"] == kinds["vllm:kv_cache_usage_perc"] == "gauge"
    assert kinds["vllm:request_success"] == kinds["vllm:prompt_tokens"] == "counter"
    for name, buckets in (("vllm:time_to_first_token_seconds", VLLM_TTFT_S),
                          ("vllm:inter_token_latency_seconds", VLLM_ITL_S),
                          ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_S),
                          ("vllm:request_queue_time_seconds", VLLM_REQUEST_S)):
        assert kinds[name] == "histogram"
        bounds = [s.labels["le"] for s in fams[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*map(str, map(float, buckets)), "+Inf"]
    # vLLM's bounds, as its v1 metrics define them
    assert VLLM_TTFT_S[:3] == (0.001, 0.005, 0.01) and VLLM_TTFT_S[-1] == 2560.0
    assert VLLM_ITL_S[0] == 0.01 and VLLM_ITL_S[-1] == 80.0 and VLLM_REQUEST_S[0] == 0.3 and VLLM_REQUEST_S[-1] == 7680.0


def test_gauges_sum_over_replicas_and_a_silent_replicas_age_out():
    clock = Clock()
    store = MetricTotals(clock=clock)
    store.add({}, {"running": 2, "waiting": 1}, "ingress-a")
    store.add({}, {"kv_usage": 0.5, "kv_replicas": 1}, "target-a")
    out = store.add({}, {"kv_usage": 0.25, "kv_replicas": 1}, "target-b")
    assert out["gauges"] == {"running": 2, "waiting": 1, "kv_usage": 0.75, "kv_replicas": 2}
    fams = {f.name: f for f in text_string_to_metric_families(_render(out))}
    assert sample(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.375  # the mean
    clock.t += GAUGE_TTL_S / 2
    store.add({}, {"kv_usage": 0.25, "kv_replicas": 1}, "target-b")  # target-b lives on
    clock.t += GAUGE_TTL_S / 2 + 1
    assert store.add({}, None, None)["gauges"] == {"kv_usage": 0.25, "kv_replicas": 1}


def _render(counts: dict) -> str:
    import prometheus_client

    from deployments.vllm_metrics import _Counts

    registry = prometheus_client.CollectorRegistry()
    registry.register(_Counts("target", {"per_pos": [], **counts}))
    return prometheus_client.generate_latest(registry).decode()


def test_a_gauge_report_sends_changes_at_most_every_interval_and_a_heartbeat():
    sent, slept = [], []

    async def send(gauges):
        sent.append(gauges)

    async def go():
        async def sleep(s):
            slept.append(s)
            await asyncio.sleep(0)

        report = GaugeReport(send, every_s=1.0, sleep=sleep)
        report.set(kv_usage=0.1, kv_replicas=1)
        report.set(kv_usage=0.2, kv_replicas=1)  # within the interval: only the latest goes
        for _ in range(int(HEARTBEAT_S) + 3):
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        report._task.cancel()
    asyncio.run(go())
    assert sent[0] == {"kv_usage": 0.2, "kv_replicas": 1}
    assert sent.count(sent[0]) == len(sent)  # nothing changed after: later sends are heartbeats
    assert len(sent) == 1 + (len(slept) - 1) // int(HEARTBEAT_S) >= 2


def test_replicas_steps_are_counted_by_server_and_state():
    store = MetricTotals(clock=Clock())
    store.add({}, {"steps": {"target": {"compiling": 1}}, "kv_usage": 0.0, "kv_replicas": 1}, "target-a")
    store.add({}, {"steps": {"target": {"failed": 1}}, "kv_usage": 0.0, "kv_replicas": 1}, "target-b")
    out = store.add({}, {"steps": {"draft": {"compiled": 1}}}, "draft-a")
    fams = {f.name: f for f in text_string_to_metric_families(_render(out))}
    got = {(s.labels["server"], s.labels["state"]): s.value for s in fams["specserve:replica_steps"].samples}
    assert got[("target", "compiling")] == got[("target", "failed")] == got[("draft", "compiled")] == 1
    assert got[("target", "compiled")] == got[("draft", "failed")] == got[("draft", "eager")] == 0
    assert len(got) == 8
