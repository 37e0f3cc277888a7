"""HTTP failover: an ASGI middleware in Serve's HTTP proxy that resumes requests whose ingress died.

A request's dispatch state lives in its ingress replica (deployments/dispatch.py): an ingress replica
that dies takes it along. The Serve proxy holding the client's connection does not die with it, so
Serve installs this middleware there (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, see
`proxy_middlewares`). It keeps the request's body and, for a stream, the state the ingress reports
beside each event (hidden SSE comments it removes: clients never see them), and when the ingress's
response breaks off it sends the request again, which Serve places on a live ingress replica:

- nothing reached the client yet (a unary request, a stream before its first event): the request
  again, from scratch;
- a stream cut part-way: the request again, with the state in the `x-specserve-resume` header; the
  new ingress continues every choice from its streamed tokens, draw seed and K controller state, so
  greedy and seeded output continue identically (unseeded ones keep their seed: the same law) and
  nothing streamed repeats or goes missing;
- after `retries` attempts, a clear error: 503 with OpenAI's body and Retry-After, or, once the
  stream has begun, an SSE error event and [DONE]. Never a silent end.

Written by hand: Serve retries nothing once a replica holds a request, and the proxy is the one
process on the HTTP path that outlives the ingress replica. Only the proxy's own death cuts a
connection with nothing said.
"""

import asyncio
import json
import logging
import os
from dataclasses import dataclass

from app.chunks import GUARD_HEADER, RESUME_HEADER, Resume, ResumeState
from app.openai.protocol import error_body
from app.openai.responses import sse_event
from deployments.args import LimitsConfig

log = logging.getLogger("ray.serve")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MARKER = b": specserve "  # an SSE comment carrying state: clients ignore comments, the middleware removes them
RETRY_AFTER_S = 1
# The proxy holds every client's connection on its node, so it bounds what it buffers before the
# ingress's own checks: a body over the limit gets 413 unread, a sender slower than the timeouts 408.
# Its limit is the ingress's default `limits.max_body_bytes`; an app that raises that sets
# SPECSERVE_PROXY_MAX_BODY_BYTES in the proxies' environment too.
MAX_BODY_BYTES = LimitsConfig.model_fields["max_body_bytes"].default
BODY_IDLE_TIMEOUT_S = 15.0  # longest wait for the next piece of a body
BODY_TIMEOUT_S = 60.0  # longest time to receive a whole body
# After refusing a body (too large, or too slow), the rest of it is read and discarded, up to these bounds, before
# the answer: a client that sends its whole body before reading (http.client, requests, httpx, the
# OpenAI SDK) then reads the 413. Closing with unread bytes resets the connection, and the client
# sees a broken pipe instead (the SDK retries those, uploading the body again). nginx's "lingering
# close" does the same for the same reason.
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0


def marker(report: dict) -> str:
    """A state report as the SSE comment the ingress writes beside an event."""
    return f"{MARKER.decode()}{json.dumps(report, separators=(',', ':'))}\n\n"


def proxy_middlewares() -> list:
    """Serve's proxy callback: the failover middleware in the proxy, nothing in a replica (whose
    direct-ingress server asks the same callback)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException
    from starlette.middleware import Middleware

    try:
        serve.get_replica_context()
        return []
    except RayServeException:
        return [Middleware(FailoverMiddleware)]


def error_event(message: str) -> bytes:
    return (sse_event(error_body(message, "service_unavailable", code=503)) + "data: [DONE]\n\n").encode()


def error_response(message: str) -> list[dict]:
    body = json.dumps(error_body(message, "service_unavailable", code=503)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode())]
    return [{"type": "http.response.start", "status": 503, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False}]


class Attempt:
    """One pass of the request through the inner app, relayed to the client.

    The response start is held until its first body message (a unary response that breaks before
    its body can still be sent again); a resumed attempt's start is dropped (the client has one);
    stream bodies are relayed event by event with the state markers taken out.
    """

    def __init__(self, send, client_started: bool, state: Resume | None):
        self.send, self.client_started, self.state = send, client_started, state
        self.start: dict | None = None
        self.status = 0
        self.sse = False
        self.finished = False  # the body ended (more_body False)
        self.pending = b""  # a stream's bytes after its last complete event
        self.held = b""  # a resumed attempt's non-stream answer (an error), to be told as an event

    async def relay(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start, self.status = message, message["status"]
            ctype = dict(message.get("headers") or []).get(b"content-type", b"")
            self.sse = ctype.startswith(b"text/event-stream")
            return
        if kind != "http.response.body":
            await self.send(message)
            return
        more = message.get("more_body", False)
        self.finished = not more
        if self.client_started and not (self.sse and self.status == 200):
            self.held += message.get("body", b"")  # a resumed attempt refused: told as an event by the caller
            return
        body = self._events(message.get("body", b""), final=not more) if self.sse else message.get("body", b"")
        if not self.client_started:
            await self.send(self.start)
            self.client_started = True
        if body or not more:
            await self.send({"type": "http.response.body", "body": body, "more_body": more})

    def _events(self, data: bytes, final: bool) -> bytes:
        """The complete events in pending + data, markers applied to the state and removed."""
        self.pending += data
        *events, self.pending = self.pending.split(b"\n\n")
        if final and self.pending:
            events, self.pending = events + [self.pending], b""
        out = []
        for event in events:
            if event.startswith(MARKER):
                self._report(json.loads(event[len(MARKER):]))
            elif event:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _report(self, report: dict) -> None:
        if "rid" in report:  # the stream's head: its id and each choice's seed (kept from the first attempt)
            if self.state is None:
                self.state = Resume(rid=report["rid"], choices=[ResumeState(seed=s) for s in report["seeds"]])
        elif self.state is not None:
            self.state.apply(report)


@dataclass(frozen=True)
class Retries:
    """Attempts after the first, and the wait before each: `backoff_s` first, doubled up to
    `max_backoff_s`. The defaults wait ~30 s in all: enough for Serve to replace a lone ingress
    replica on a busy node (13 s measured on an idle one), while a second replica takes the request
    at the first retry."""

    retries: int = 18
    backoff_s: float = 0.25
    max_backoff_s: float = 2.0


@dataclass(frozen=True)
class BodyLimits:
    """How a POST body is read: at most `max_bytes` (None: SPECSERVE_PROXY_MAX_BODY_BYTES, else the
    ingress's default), within the idle and whole-body timeouts; of a refused one, at most `drain`
    (bytes, seconds) is read and discarded before the answer."""

    max_bytes: int | None = None
    idle_timeout_s: float = BODY_IDLE_TIMEOUT_S
    timeout_s: float = BODY_TIMEOUT_S
    drain: tuple[int, float] = (DRAIN_BYTES, DRAIN_S)


class FailoverMiddleware:
    """See the module docstring."""

    def __init__(self, app, retries: Retries = Retries(), body: BodyLimits = BodyLimits(), sleep=asyncio.sleep):
        self.app, self.sleep = app, sleep
        self.retries, self.backoff_s, self.max_backoff_s = retries.retries, retries.backoff_s, retries.max_backoff_s
        self.max_body_bytes = body.max_bytes or int(os.environ.get("SPECSERVE_PROXY_MAX_BODY_BYTES") or MAX_BODY_BYTES)
        self.idle_timeout_s, self.body_timeout_s, self.drain = body.idle_timeout_s, body.timeout_s, body.drain

    async def __call__(self, scope, receive, send):
        """Every POST's body is read here within the limits (so every route refuses alike, and
        readably); generation requests are then retried on another ingress replica when theirs fails."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await _read_body(scope, receive, self.max_body_bytes, self.idle_timeout_s, self.body_timeout_s)
        except _ClientGone:
            return
        except _Refused as e:
            if e.unread is not None:  # a 413's or a 408's client may still be sending: read on, then answer
                await _drain(receive, e.unread, *self.drain)
            for m in e.messages():
                await send(m)
            return
        client = {"gone": False}
        if scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, _replay(body, receive, client), send)
        headers = [(k, v) for k, v in scope["headers"] if not k.startswith(b"x-specserve-")]
        headers.append((GUARD_HEADER, b"1"))
        started, state, why = False, None, "the ingress replica stopped"
        for attempt in range(self.retries + 1):
            if attempt:
                await self.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            resume = [(RESUME_HEADER, state.model_dump_json().encode())] if state is not None else []
            run = Attempt(send, started, state)
            try:
                await self.app({**scope, "headers": headers + resume}, _replay(body, receive, client), run.relay)
                why = run.held.decode(errors="replace")[:300] if run.held else "the ingress replica stopped"
            except Exception as e:  # the proxy's own failure to reach a replica
                why = f"{type(e).__name__}: {e}"
            started, state = run.client_started, run.state
            if client["gone"] or (run.finished and not run.held):
                return  # answered (a refusal with its own body included), or nobody is listening
            if started and state is None:
                break  # part of a response the ingress gave no state for (not a stream): nothing to resume from
            log.warning("failover: %s broke off (%s), attempt %d of %d", scope["path"], why, attempt + 1,
                        self.retries + 1)
        message = f"the server could not finish this request ({why}); retry it"
        if started:
            await send({"type": "http.response.body", "body": error_event(message), "more_body": False})
        else:
            for m in error_response(message):
                await send(m)


class _ClientGone(Exception):
    """The client went away before its body was read."""


class _Refused(Exception):
    """A body the proxy will not read on: answered with `status` and OpenAI's body. `unread`: whether
    the client may still be sending it (True), or holds it back until it hears from us (None: it
    asked `Expect: 100-continue` and nothing was read, so the answer goes before any body)."""

    def __init__(self, status: int, message: str, type_: str, unread: bool | None = True):
        super().__init__(message)
        self.status, self.type, self.unread = status, type_, unread

    def messages(self) -> list[dict]:
        body = json.dumps(error_body(str(self), self.type, code=self.status)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        return [{"type": "http.response.start", "status": self.status, "headers": headers},
                {"type": "http.response.body", "body": body, "more_body": False}]


async def _read_body(scope, receive, limit: int, idle_timeout_s: float, timeout_s: float) -> bytes:
    """The whole request body, read within `limit` bytes and the timeouts (a declared length over
    the limit is refused before reading); raises _Refused or _ClientGone."""
    too_large = _Refused(413, f"request body over {limit} bytes", "invalid_request_error")
    headers = dict(scope["headers"])
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        if headers.get(b"expect", b"").lower() == b"100-continue":
            too_large.unread = None  # answered before the client sends (reading would ask it to)
        raise too_large
    loop = asyncio.get_running_loop()
    deadline, parts, size = loop.time() + timeout_s, [], 0
    while True:
        wait = min(idle_timeout_s, deadline - loop.time())
        try:
            message = await asyncio.wait_for(receive(), max(wait, 0.001))
        except asyncio.TimeoutError:
            raise _Refused(408, f"request body not received in time (a pause over {idle_timeout_s:g} s or over "
                                f"{timeout_s:g} s in all)", "timeout_error") from None
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            too_large.unread = message.get("more_body", False)
            raise too_large
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _drain(receive, unread: bool, max_bytes: int, max_s: float) -> None:
    """Read and discard what is left of a refused body, within `max_bytes` and `max_s`; whatever
    is left past them is the client's loss (the connection closes on it)."""
    loop = asyncio.get_running_loop()
    deadline, size = loop.time() + max_s, 0
    while unread and size <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        unread = message.get("more_body", False)


def _replay(body: bytes, receive, client: dict):
    """A receive() that gives the kept body first, then waits on the client (its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message = await receive()
        if message["type"] == "http.disconnect":
            client["gone"] = True
        return message

    return replay
