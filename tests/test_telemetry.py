"""Tracing helpers and the round observer, without Ray: fake draft/target servers that see the trace
context only through the items they are sent, as the real deployments do across Ray calls."""

import asyncio
import contextvars

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from app import telemetry
from app.speculation.controller import CostEstimator, KController, KControllerConfig
from app.speculation.driver import DraftUnavailable, RoundContext, run_rounds
from app.params import SamplingParams
from app.job import GenerationJob
from app.request import RequestState
from app.speculation.steps import Proposal, ProposeItem, Verdict, VerifyItem

TOKEN = 5


class FakeServers:
    """A draft proposing TOKEN k times and a target accepting the first `accept` of them.

    Each call runs in an empty contextvars context, so a server span can only find its parent
    through the item's carrier (as in another process).
    """

    def __init__(self, accept: int = 2, draft_error: str | None = None):
        self.accept, self.draft_error = accept, draft_error
        self.items: list = []

    def _serve(self, name: str, item, answer):
        def run():
            with telemetry.batch_spans(name, [item.trace], {"specserve.batch_size": 1, "specserve.replica": "r1"}):
                return answer()
        self.items.append(item)
        return contextvars.Context().run(run)

    async def propose(self, item: ProposeItem) -> Proposal:
        if self.draft_error:
            raise DraftUnavailable("no draft", self.draft_error)
        k = item.k
        return self._serve("DraftServer.propose", item, lambda: Proposal(
            [TOKEN] * k, torch.full((k, 1), TOKEN), torch.ones(k, 1), {"forward_s": 0.001}))

    async def verify(self, item: VerifyItem) -> Verdict:
        drafted = len(item.proposal.tokens)
        accepted = min(self.accept, drafted)
        return self._serve("TargetServer.verify", item, lambda: Verdict(
            [TOKEN] * (accepted + 1), accepted, drafted, {"batch_size": 3, "forward_s": 0.002}))


class Recorder:
    def __init__(self):
        self.facts: list[telemetry.RoundFacts] = []

    def round(self, facts):
        self.facts.append(facts)


class NeverSpeculates:
    """A controller that finds speculation never pays."""

    def choose(self, c, verify_cost=0.0, overhead=0.0):
        return 0

    def observe(self, k, accepted):
        pass


@pytest.fixture()
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    yield exporter
    telemetry.install(None)


def run_request(tokenizer, servers, max_tokens=10, k=3, controller=None, observer=None, traced=True):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, speculation={"num_tokens": k})
    state = RequestState(GenerationJob("req-1", [3, 4], params, 0), tokenizer, 512)
    controller = controller or KController(KControllerConfig(k_max=8), pinned_k=k)

    async def go():
        root = telemetry.start_span("generate") if traced else None
        async for _ in run_rounds(state, RoundContext(servers.propose, servers.verify, CostEstimator()), controller,
                                  observer=observer or Recorder(), trace_parent=telemetry.context_of(root)):
            pass
        if root is not None:
            root.end()
    asyncio.run(go())
    return state


@pytest.mark.parametrize("env, wanted", [
    ({}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, "otlp"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, "otlp"),
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, None),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, None),
])
def test_tracing_is_off_unless_otel_variables_ask(env, wanted):
    assert telemetry.wanted_from_env(env) == wanted


def test_configure_tracing_installs_an_exporter_only_when_asked():
    try:
        assert not telemetry.configure_tracing("test", env={})
        assert not telemetry.enabled()
        assert telemetry.configure_tracing("test", env={"OTEL_TRACES_EXPORTER": "console"})
        assert telemetry.enabled()
    finally:
        telemetry.install(None)
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        telemetry.configure_tracing("test", env={"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_every_helper_is_a_no_op(tokenizer):
    telemetry.install(None)
    with telemetry.span("x") as s:
        assert s is None
        assert telemetry.carrier() is None
    assert telemetry.start_span("x") is None and telemetry.context_of(None) is None
    servers = FakeServers()
    run_request(tokenizer, servers, traced=False)
    assert servers.items and all(it.trace is None for it in servers.items)


def test_one_trace_per_request_with_parent_links_through_the_items(tokenizer, spans):
    state = run_request(tokenizer, FakeServers(accept=2), max_tokens=10, k=3)
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    parent = lambda s: by_id[s.parent.span_id].name if s.parent else None  # noqa: E731
    assert len({s.context.trace_id for s in finished}) == 1
    names = [s.name for s in finished]
    assert names.count("generate") == 1 and names.count("round") == state.stats.rounds
    # the draft's proposal for the prompt is asked beside the prompt's prefill, before the first round
    expected = {"round": {"generate"}, "draft.propose": {"round", "draft.beside_prefill"},
                "target.verify": {"round"}, "DraftServer.propose": {"draft.propose"},
                "TargetServer.verify": {"target.verify"}, "draft.beside_prefill": {"generate", "round"}}
    for s in finished:
        if s.name != "generate":
            assert parent(s) in expected[s.name], s.name
    assert names.count("draft.beside_prefill") == 1
    # and it did ask: one proposal drafted beside the prefill (for 3 days one was not, unseen: the
    # round cleared its first-round flag before asking)
    assert [parent(s) for s in finished if s.name == "draft.propose"].count("draft.beside_prefill") == 1
    rounds = [s for s in finished if s.name == "round"]
    assert sum(s.attributes["specserve.accepted"] for s in rounds) == state.stats.accepted_tokens
    assert rounds[0].attributes["specserve.k"] == 0  # the prompt's round: a plain step
    assert all(s.attributes["specserve.k"] == 3 and s.attributes["specserve.batch_size"] == 3 for s in rounds[1:-1])
    assert all(s.attributes["specserve.replica"] == "r1" for s in finished if "Server" in s.name)


def test_draft_failure_shows_as_fallback_reason(tokenizer, spans):
    observer = Recorder()
    state = run_request(tokenizer, FakeServers(draft_error="deadline"), max_tokens=4, observer=observer)
    # every round that asked the draft fell back (the last, with room for one token, asks nothing)
    assert {f.fallback for f in observer.facts if f.k} == {"deadline"}
    assert state.stats.fallback_rounds == sum(bool(f.k) for f in observer.facts) > 0
    assert state.stats.drafted_tokens == 0
    finished = spans.get_finished_spans()
    assert {s.attributes.get("specserve.fallback_reason") for s in finished if s.name == "round"} == {"deadline", None}
    assert all(s.status.status_code == StatusCode.ERROR for s in finished if s.name == "draft.propose")
    assert not any(s.name == "DraftServer.propose" for s in finished)


def test_observer_sees_what_the_stats_record(tokenizer):
    observer = Recorder()
    state = run_request(tokenizer, FakeServers(accept=2), max_tokens=11, k=3, observer=observer, traced=False)
    f, st = observer.facts, state.stats
    assert len(f) == st.rounds
    assert sum(x.drafted for x in f) == st.drafted_tokens and sum(x.accepted for x in f) == st.accepted_tokens
    assert sum(x.emitted for x in f) == st.emitted_tokens
    assert all(x.fallback is None and x.batch_size == 3 for x in f)
    assert all(x.draft_forward_s == 0.001 and x.verify_forward_s == 0.002 for x in f if x.drafted)
    assert all(x.round_s >= x.draft_s + x.verify_s for x in f)


def test_controller_choosing_k0_is_a_controller_fallback(tokenizer):
    observer = Recorder()
    state = run_request(tokenizer, FakeServers(), max_tokens=3, k="auto", controller=NeverSpeculates(),
                        observer=observer, traced=False)  # the request leaves K to the controller
    # the first round is the prompt's prefill, a plain step whatever the controller says
    assert [f.fallback for f in observer.facts] == [None, "controller", "controller"]
    assert [f.prompt for f in observer.facts] == [True, False, False]
    assert state.stats.fallback_rounds == 2 and all(f.k == 0 for f in observer.facts)
