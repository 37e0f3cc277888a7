"""Tracing set-up from the standard OTEL_* variables, span helpers, and the per-round observer hook.

Off unless configured: with no OTLP endpoint or exporter named, every helper is a no-op that
creates nothing (a flag check), so an untraced request pays near zero. The trace context crosses
Ray calls as a W3C `traceparent` carrier dict carried by the ProposeItem / VerifyItem.
Metrics are not here: the Ray metric objects live in deployments/metrics.py and see each round
through a RoundObserver.
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

TRACER_NAME = "specserve"
FALLBACK_REASONS = ("draft_unavailable", "deadline", "controller", "draft_behind", "goodput")
STEP_STATES = ("compiling", "compiled", "eager", "failed")  # what steps_state() says of a runner's compile_status


def steps_state(status: str) -> str:
    """The kind of a ModelRunner's compile_status, one of STEP_STATES: "failed" for a build that failed
    twice or steps that failed their check (the runner runs eagerly, and was meant to compile)."""
    if status.startswith("compiling"):
        return "compiling"
    return status if status in ("compiled", "eager") else "failed"

_tracer: trace.Tracer | None = None  # None = tracing off


# -- the round observer --------------------------------------------------------------------------
@dataclass
class RoundFacts:
    """What one round did, as the driver saw it."""

    k: int  # K asked of the draft (0 = a plain target step)
    drafted: int  # draft tokens the target checked
    accepted: int  # of those, accepted
    emitted: int  # tokens the round produced: accepted + one recovered or bonus token
    fallback: str | None  # why the round ran without the draft (FALLBACK_REASONS), None if it did not
    round_s: float
    draft_s: float  # propose round trip (0 when not drafted)
    verify_s: float  # verify round trip
    draft_forward_s: float  # the draft replica's batch forward within draft_s
    verify_forward_s: float  # the target replica's batch forward within verify_s
    batch_size: int  # verify batch this round rode in
    ahead_hit: bool | None = None  # a proposal drafted ahead was used (True), discarded (False); None: none
    draft_hidden_s: float = 0.0  # of the proposal's round trip, the part that ran while the last round verified
    prompt: bool = False  # the request's first round: the prompt's prefill, a plain step by design


class RoundObserver(Protocol):
    """Told about every round of a request (metrics, logs)."""

    def round(self, facts: RoundFacts) -> None: ...


class NoObserver:
    def round(self, facts: RoundFacts) -> None:
        pass


# -- configuration -------------------------------------------------------------------------------
def wanted_from_env(env=os.environ) -> str | None:
    """The exporter the OTEL_* variables ask for ("otlp", "console"), or None for tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return None if named == "none" else named.split(",")[0].strip()
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return None


def configure_tracing(component: str, env=os.environ) -> bool:
    """Install an SDK tracer (OTLP over HTTP, or console) when OTEL_* asks for one; True if tracing is on.

    Idempotent per process. Sampling follows OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG and
    export batching OTEL_BSP_*, both read by the SDK itself.
    """
    if _tracer is not None:
        return True
    exporter_name = wanted_from_env(env)
    if exporter_name is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, headers, timeout
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r} is not supported: use otlp, console or none")
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "specserve",
                                "specserve.component": component})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    return True


def install(provider: trace.TracerProvider | None) -> None:
    """Trace through `provider` (tests pass one with an in-memory exporter); None turns tracing off."""
    global _tracer
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None


def enabled() -> bool:
    return _tracer is not None


# -- spans ---------------------------------------------------------------------------------------
Parent = dict | otel_context.Context | None  # a W3C carrier, a context, or None = the current span


def _context(parent: Parent) -> otel_context.Context | None:
    if parent is None or isinstance(parent, otel_context.Context):  # (a Context is a dict too)
        return parent
    return propagate.extract(parent)


def start_span(name: str, parent: Parent = None, attributes: dict | None = None,
               kind: SpanKind = SpanKind.INTERNAL) -> Span | None:
    """A span the caller ends (for spans that outlive a `with`: a streamed request); None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes)


@contextlib.contextmanager
def _span(name: str, parent: Parent, attributes: dict | None, kind: SpanKind) -> Iterator[Span]:
    with _tracer.start_as_current_span(name, context=_context(parent), kind=kind, attributes=attributes) as s:
        yield s


def span(name: str, parent: Parent = None, attributes: dict | None = None,
         kind: SpanKind = SpanKind.INTERNAL) -> contextlib.AbstractContextManager[Span | None]:
    """A span that is current inside the `with` (yields None when off). Never hold it across a yield."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _span(name, parent, attributes, kind)


def context_of(s: Span | None) -> otel_context.Context | None:
    """The context whose parent is `s`, to pass as `parent=` on; None when off."""
    return trace.set_span_in_context(s) if s is not None else None


def carrier(s: Span | None = None) -> dict | None:
    """The W3C trace context of `s` (default: the current span) as a dict for a Ray call; None when off."""
    if _tracer is None:
        return None
    out: dict = {}
    propagate.inject(out, context=context_of(s))
    return out or None


def set_attributes(s: Span | None, attributes: dict) -> None:
    if s is not None:
        s.set_attributes({k: v for k, v in attributes.items() if v is not None})


def round_attributes(facts: RoundFacts) -> dict:
    """The attributes of a round span."""
    return {"specserve.k": facts.k, "specserve.drafted": facts.drafted, "specserve.accepted": facts.accepted,
            "specserve.emitted": facts.emitted, "specserve.batch_size": facts.batch_size,
            "specserve.fallback_reason": facts.fallback}


@contextlib.contextmanager
def batch_spans(name: str, carriers: list[dict | None], attributes: dict) -> Iterator[list[Span]]:
    """One server span per traced item of a batch, each a child of its item's context; all end together."""
    if _tracer is None or not any(carriers):
        yield []
        return
    spans = [_tracer.start_span(name, context=propagate.extract(c), kind=SpanKind.SERVER, attributes=attributes)
             for c in carriers if c]
    try:
        yield spans
    finally:
        for s in spans:
            s.end()
