"""The proxy's failover middleware (deployments/failover.py) against a scripted ingress: a request
whose ingress breaks off is sent again; a cut stream continues from the state the ingress reported,
and the client sees exactly the undisturbed stream; when nothing answers, a clear error."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from app.chunks import GUARD_HEADER, RESUME_HEADER, Resume, ResumeState, read_resume
from deployments.failover import MARKER, FailoverMiddleware, Retries, marker

TOKENS = 10  # per choice
PER_EVENT = 2


def token(seed: int, position: int) -> int:
    return (seed * 31 + position * 7) % 97


class ScriptedIngress:
    """An ASGI app standing in for the proxy-with-ingress: streams each choice's tokens two per event,
    reporting state as the real ingress does when guarded, and continuing from a resume header.

    `script[k]`: what attempt k does: ("die", n) stops after n events without ending the body (the
    proxy's behaviour when the replica under it dies; n = 0: before the response starts),
    ("refuse", status) answers an error body, None runs to the end."""

    def __init__(self, script: list, choices: int = 2):
        self.script, self.choices, self.calls = script, choices, []

    async def __call__(self, scope, receive, send):
        headers = dict(scope["headers"])
        request = json.loads((await receive())["body"])
        self.calls.append(headers)
        watch = asyncio.ensure_future(receive())  # as Serve's proxy does: it listens for the client leaving
        await asyncio.sleep(0)
        try:
            await self._respond(request, headers, send)
        finally:
            watch.cancel()

    async def _respond(self, request: dict, headers: dict, send):
        act = self.script[len(self.calls) - 1] if len(self.calls) <= len(self.script) else None
        if act and act[0] == "refuse":
            body = json.dumps({"error": {"message": f"refused {act[1]}", "type": "x", "param": None,
                                         "code": act[1]}}).encode()
            await send({"type": "http.response.start", "status": act[1],
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        die_after = act[1] if act else None
        if not request.get("stream"):
            if die_after is not None:
                return
            text = "".join(f"<{token(1, p)}>" for p in range(TOKENS))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps({"text": text}).encode()})
            return
        guarded = headers.get(GUARD_HEADER) == b"1"
        resume = read_resume(headers[RESUME_HEADER].decode()) if RESUME_HEADER in headers else None
        states = resume.choices if resume else [ResumeState(seed=100 + i) for i in range(self.choices)]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if guarded:
            await send({"type": "http.response.body", "more_body": True,
                        "body": marker({"rid": "cmpl-1", "seeds": [c.seed for c in states]}).encode()})
        events = 0
        while not all(c.done for c in states):
            for i, c in enumerate(states):
                if c.done:
                    continue
                if die_after is not None and events == die_after:
                    return
                ids = [token(c.seed, p) for p in range(len(c.output_ids), min(len(c.output_ids) + PER_EVENT, TOKENS))]
                text = "".join(f"<{t}>" for t in ids)
                done = len(c.output_ids) + len(ids) == TOKENS
                c.record({"token_ids": ids, "text": text, **({"finish_reason": "length"} if done else {})})
                event = f"data: {json.dumps({'index': i, 'text': text, 'done': c.done})}\n\n"
                if guarded:
                    event += marker({"i": i, "token_ids": ids, "text": text, "controller": [1.0, 0.5, len(c.output_ids)],
                                     **({"finish_reason": "length"} if c.done else {})})
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                events += 1
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def serve(app, body: dict, path: str = "/v1/completions", method: str = "POST", headers=(), disconnect=False,
          retries: int = 4):
    """One request through the middleware: (messages sent to the client, the waits it slept)."""
    sent, waits = [], []

    async def sleep(s):
        waits.append(s)

    async def go():
        raw = json.dumps(body).encode()
        queue = [{"type": "http.request", "body": raw[:5], "more_body": True},
                 {"type": "http.request", "body": raw[5:], "more_body": False}]

        async def receive():
            if queue:
                return queue.pop(0)
            if disconnect:
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-type", b"application/json"),
                                                                             *headers]}
        await FailoverMiddleware(app, Retries(retries), sleep=sleep)(scope, receive, send)
    asyncio.run(go())
    return sent, waits


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def choices_of(body: bytes) -> dict:
    """A stream's events per choice, in order (how events of different choices interleave is the
    server's timing, not content), with the end of the stream."""
    out = {}
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            e = json.loads(event[6:])
            out.setdefault(e.get("index", "error"), []).append(e.get("text", e.get("error")))
        elif event:
            out.setdefault("end", []).append(event)
    return out


def undisturbed(choices: int = 2) -> dict:
    sent, _ = serve(ScriptedIngress([], choices), {"stream": True})
    return choices_of(body_of(sent))


def test_an_undisturbed_stream_passes_unchanged_without_its_state_reports():
    sent, waits = serve(ScriptedIngress([]), {"stream": True})
    body = body_of(sent)
    assert MARKER not in body and body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"data: {") == 2 * TOKENS // PER_EVENT
    assert [m["type"] for m in sent].count("http.response.start") == 1 and waits == []
    assert sent[-1]["more_body"] is False


@pytest.mark.parametrize("cuts", [[3], [1, 2, 4], [5]])
def test_a_stream_cut_part_way_continues_where_it_was_cut(cuts):
    app = ScriptedIngress([("die", n) for n in cuts])
    sent, waits = serve(app, {"stream": True})
    assert choices_of(body_of(sent)) == undisturbed()  # nothing repeated, nothing missing, no report leaked
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert len(app.calls) == len(cuts) + 1 and waits == [0.25 * 2 ** k for k in range(len(cuts))]
    first_resume = read_resume(app.calls[1][RESUME_HEADER].decode())
    assert first_resume.rid == "cmpl-1" and [c.seed for c in first_resume.choices] == [100, 101]
    # the state sent is what was streamed before the first cut: events alternate between the choices
    streamed = [sum(PER_EVENT for e in range(cuts[0]) if e % 2 == i) for i in range(2)]
    assert [len(c.output_ids) for c in first_resume.choices] == streamed
    assert all(c.output_ids == [token(c.seed, p) for p in range(len(c.output_ids))] for c in first_resume.choices)


def test_a_choice_finished_before_the_cut_is_not_generated_again():
    app = ScriptedIngress([("die", 6)], choices=2)  # 10 tokens = 5 events per choice: choice 0 ends at event 9
    sent, _ = serve(app, {"stream": True})
    assert choices_of(body_of(sent)) == undisturbed()
    app = ScriptedIngress([("die", 9)], choices=2)
    sent, _ = serve(app, {"stream": True})
    resume = read_resume(app.calls[1][RESUME_HEADER].decode())
    assert [c.done for c in resume.choices] == [True, False]
    assert choices_of(body_of(sent)) == undisturbed()


def test_a_unary_request_whose_ingress_died_is_sent_again_from_scratch():
    app = ScriptedIngress([("die", 0), ("die", 0)])
    sent, waits = serve(app, {"stream": False})
    assert sent[0]["status"] == 200 and json.loads(body_of(sent))["text"].startswith("<")
    assert len(app.calls) == 3 and waits == [0.25, 0.5]
    assert all(RESUME_HEADER not in c for c in app.calls)  # nothing was streamed: nothing to resume


def test_a_unary_request_nothing_answers_gets_503_with_openai_body_and_retry_after():
    app = ScriptedIngress([("die", 0)] * 10)
    sent, waits = serve(app, {"stream": False}, retries=3)
    assert len(app.calls) == 4 and len(waits) == 3
    start = sent[0]
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    err = json.loads(body_of(sent))["error"]
    assert err["type"] == "service_unavailable" and "retry" in err["message"]


def test_a_stream_nothing_can_continue_ends_with_an_error_event_never_silently():
    app = ScriptedIngress([("die", 2)] + [("die", 0)] * 10)
    sent, _ = serve(app, {"stream": True}, retries=3)
    body = body_of(sent)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == 503
    got, want = choices_of(body), undisturbed()
    assert got[0] == want[0][:1] and got[1] == want[1][:1]  # the two events streamed before the cut, once
    assert sent[-1]["more_body"] is False and [m["type"] for m in sent].count("http.response.start") == 1


def test_a_resumed_attempt_that_is_refused_is_tried_again_then_told_as_an_event():
    app = ScriptedIngress([("die", 3), ("refuse", 503), None])
    sent, _ = serve(app, {"stream": True})
    assert choices_of(body_of(sent)) == undisturbed() and len(app.calls) == 3
    app = ScriptedIngress([("die", 3)] + [("refuse", 400)] * 10)
    sent, _ = serve(app, {"stream": True}, retries=2)
    events = [e for e in body_of(sent).split(b"\n\n") if e]
    assert b"refused 400" in events[-2] and events[-1] == b"data: [DONE]"


def test_a_client_cannot_send_state_of_its_own():
    app = ScriptedIngress([])
    forged = Resume(rid="x", choices=[ResumeState(seed=1, output_ids=[5, 5, 5])]).model_dump_json().encode()
    serve(app, {"stream": True}, headers=[(RESUME_HEADER, forged), (GUARD_HEADER, b"0")])
    assert RESUME_HEADER not in app.calls[0] and app.calls[0][GUARD_HEADER] == b"1"


def test_a_client_that_went_away_is_not_retried():
    app = ScriptedIngress([("die", 2)])
    serve(app, {"stream": True}, disconnect=True)
    assert len(app.calls) == 1


def test_other_routes_pass_straight_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    sent, _ = serve(app, {}, path="/v1/models", method="GET")
    assert len(seen) == 1 and GUARD_HEADER not in dict(seen[0]) and body_of(sent) == b"{}"


def test_resume_state_is_checked():
    with pytest.raises(ValueError, match="x-specserve-resume"):
        read_resume('{"rid": "x", "choices": [{"seed": 1, "controller": [1, -2, 0]}]}')
    with pytest.raises(ValueError):
        read_resume('{"rid": "x", "choices": [{"seed": 1, "streamed_chars": -1}]}')
    assert read_resume(None) is None


def test_a_resumed_view_neither_echoes_again_nor_restarts_its_text_offsets(tokenizer):
    from app.openai.responses import ChoiceView

    ids = tokenizer("def f(x):")["input_ids"]
    whole = ChoiceView(tokenizer, chat=False, logprobs=True, echo="def f(x):", prompt_ids=ids)
    entry = [-0.5, [[ids[0], -0.5]]]
    first, second = {"text": "ab", "token_ids": [ids[0]], "logprobs": [entry]}, \
        {"text": "cd", "token_ids": [ids[1]], "logprobs": [entry]}
    whole.render(first)
    _, want = whole.render(second)
    resumed = ChoiceView(tokenizer, chat=False, logprobs=True, echo="def f(x):", prompt_ids=ids)
    resumed.resume(streamed_chars=len(first["text"]))
    text, got = resumed.render(second)
    assert text == "cd" and got == want


def test_an_ingress_answers_resume_state_that_does_not_fit_the_request_with_a_400(tokenizer):
    from app.errors import APIError
    from app.job import GenerationJob
    from app.openai.front import FrontSettings, OpenAIFront
    from app.params import SamplingParams

    front, jobs = OpenAIFront(tokenizer, FrontSettings("m", 64)), [GenerationJob.new([1, 2], SamplingParams(max_tokens=4))]

    def resume(state, stream=True):
        return front._resume(state, SimpleNamespace(stream=stream), jobs)

    def state(*choices):
        return json.dumps({"rid": "cmpl-1", "choices": list(choices)})
    assert resume(state({"seed": 1, "output_ids": [3, 4], "streamed_chars": 2})).choices[0].output_ids == [3, 4]
    assert resume(None) is None
    for bad, stream in [(state({"seed": 1, "output_ids": [len(tokenizer)]}), True),  # outside the vocabulary
                        (state({"seed": 1, "output_ids": [1] * 5}), True),  # more than max_tokens
                        (state({"seed": 1}, {"seed": 2}), True),  # two choices for one
                        (state({"seed": 2**63}), True),  # a seed no generator takes
                        # non-finite or huge controller state: int() of it raised on the target, after
                        # which the request held its slot until its timeout
                        (state({"seed": 1, "controller": [float("nan"), 1, 1]}), True),
                        (state({"seed": 1, "controller": [1, float("inf"), 1]}), True),
                        (state({"seed": 1, "controller": [1, 1, 1e300]}), True),
                        (state({"seed": 1, "streamed_chars": 2**64}), True),
                        ('{"rid": "x", "choices": ' + "[" * 10000 + "]" * 10000 + "}", True),  # deep nesting
                        ("not json", True),
                        (state({"seed": 1}), False)]:  # a unary request has no stream to resume
        with pytest.raises(APIError) as e:
            resume(bad, stream)
        assert e.value.status == 400 and RESUME_HEADER.decode() in e.value.message
