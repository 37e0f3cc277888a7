"""Hostile input at the edge, without Ray: every bad value is refused, naming its field, before
anything shared is built from it; the proxy bounds what it buffers; every stream ends."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.errors import InvalidRequestError
from app.openai.protocol import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, load_json, normalise_body
from app.params import SamplingParams, SpeculationParams, check_vocabulary, parse_sampling
from deployments.failover import BodyLimits, FailoverMiddleware

BASE = {"model": "m", "prompt": "hi"}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate(normalise_body({**BASE, **fields}, CompletionRequest))


def refused_param(**fields) -> str:
    """The parameter a request with these fields is refused for (pydantic's loc, as the ingress names it)."""
    with pytest.raises(ValidationError) as e:
        completion(**fields)
    return ".".join(str(p) for p in e.value.errors()[0]["loc"])


@pytest.mark.parametrize("key", ["²", "١٢", "٣", "0x1", "-1", " 1", "1 ", "01", "1e3", "+1", "", "9" * 1000])
def test_logit_bias_keys_must_be_token_ids_in_ascii_decimal(key):
    # "²".isdigit() is true and int("²") raises: that reached the request's shared path as a 500
    assert refused_param(logit_bias={key: 1}) == "logit_bias"


def test_canonical_logit_bias_keys_are_accepted():
    assert completion(logit_bias={"0": 1, "42": -100}).sampling(4, SpeculationParams()).logit_bias == {0: 1, 42: -100}


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 1e30), ("top_k", -2), ("max_tokens", 2**64), ("min_tokens", 2**63),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("n", 10**6), ("logprobs", 21),
    ("stop_token_ids", [2**63]), ("stop_token_ids", [-1]), ("stop", ["x" * 5000]), ("stop", ["a"] * 5),
    ("logit_bias", {str(i): 1 for i in range(2000)}), ("temperature", float("nan")), ("top_p", float("inf")),
    ("presence_penalty", float("-inf")), ("logit_bias", {"1": float("nan")}), ("cache_salt", "s" * 1000),
])
def test_out_of_range_values_are_refused_naming_their_field(field, value):
    assert refused_param(**{field: value}).split(".")[0] == field


def test_sampling_params_take_no_nan_nor_unbounded_integers_whoever_builds_them():
    """A job sent over a Serve handle builds SamplingParams itself: the same bounds hold there."""
    for bad in [{"top_k": 2**63}, {"temperature": float("nan")}, {"min_p": float("inf")},
                {"logit_bias": {2**40: 1.0}}, {"stop_token_ids": [2**63]}, {"max_tokens": 2**63},
                {"speculation": {"num_tokens": 2**40}}]:
        with pytest.raises(InvalidRequestError) as e:
            parse_sampling(bad)
        assert e.value.param.split(".")[0] == next(iter(bad))


def test_the_vocabulary_bounds_top_k_and_token_ids():
    check_vocabulary(SamplingParams(top_k=98, stop_token_ids=[97], logit_bias={97: 1.0}), 98)
    for bad, param in [({"top_k": 99}, "top_k"), ({"stop_token_ids": [98]}, "stop_token_ids"),
                       ({"logit_bias": {98: 1.0}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError) as e:
            check_vocabulary(SamplingParams(**bad), 98)
        assert e.value.param == param


@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"temperature": Infinity}', b'{"x": -Infinity}',
                                 b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 1000 + b"1" + b"}" * 1000,
                                 b"\xff\xfe", b'{"a": 1'])
def test_bodies_that_are_not_plain_bounded_json_are_refused(raw):
    with pytest.raises(InvalidRequestError):
        load_json(raw)


def test_json_nested_to_the_limit_is_read():
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(nested.encode()) is not None
    with pytest.raises(InvalidRequestError):
        load_json(("[" + nested + "]").encode())


def test_a_chat_with_a_deep_response_format_is_refused_before_validation():
    schema = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with pytest.raises(InvalidRequestError):
        ChatCompletionRequest.model_validate(load_json(json.dumps(body).encode()))


# -- the proxy's middleware reads bounded bodies ---------------------------------------------------
class Inner:
    """The app behind the middleware: records whether a request reached it."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def through_middleware(chunks, headers=(), limit=1000, idle=5.0, total=60.0, path="/v1/completions",
                       drain=(1 << 20, 10.0)):
    """Send a body in `chunks` (None: the client pauses for good) through the middleware: (status,
    error body or None, the inner app, chunks the middleware read)."""
    inner, sent, read = Inner(), [], []

    async def go():
        pending = list(chunks)

        async def receive():
            if not pending:
                await asyncio.Event().wait()
            part = pending.pop(0)
            if part is None:
                await asyncio.Event().wait()
            read.append(part)
            return {"type": "http.request", "body": part, "more_body": bool(pending)}

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
        await FailoverMiddleware(inner, body=BodyLimits(limit, idle, total, drain))(scope, receive, send)
    asyncio.run(go())
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body).get("error"), inner, read


def test_a_body_over_the_limit_is_refused_after_the_rest_is_read_and_discarded():
    """A client that sends its whole body before reading (http.client, requests, httpx) reads the 413
    only if the connection is not closed on its unread bytes: the rest is read, and dropped."""
    status, error, inner, read = through_middleware([b"x" * 600] * 100)
    assert status == 413 and error["type"] == "invalid_request_error" and inner.calls == 0
    assert len(read) == 100  # all of it, and none kept: the inner app never saw it


def test_draining_a_refused_body_stops_at_its_bound():
    status, _, _, read = through_middleware([b"x" * 600] * 100, drain=(3000, 10.0))
    assert status == 413 and len(read) == 2 + 6  # to the chunk past the limit, then past 3000 bytes more
    status, _, _, read = through_middleware([b"x" * 600] * 3 + [None], drain=(1 << 20, 0.05))
    assert status == 413 and len(read) == 3  # a sender that stalls is answered when the drain's time is up


def test_a_declared_length_over_the_limit_is_refused_before_any_read_when_the_client_waits_for_it():
    """`Expect: 100-continue`: the client sends nothing until told to, so the 413 goes first."""
    status, _, inner, read = through_middleware([b"{}"], headers=[(b"content-length", b"10000000000"),
                                                                  (b"expect", b"100-continue")])
    assert status == 413 and inner.calls == 0 and read == []
    status, _, inner, read = through_middleware([b"{}"], headers=[(b"content-length", b"10000000000")])
    assert status == 413 and inner.calls == 0 and read == [b"{}"]  # sent anyway: read, then answered


def test_every_post_route_reads_its_body_within_the_limit():
    status, _, inner, _ = through_middleware([b"x" * 600] * 3, path="/tokenize")
    assert status == 413 and inner.calls == 0
    status, _, inner, _ = through_middleware([b'{"prompt":', b' "x"}'], path="/tokenize")
    assert status == 200 and inner.calls == 1


def test_a_sender_that_stalls_gets_408():
    status, error, inner, _ = through_middleware([b'{"a":', None], idle=0.01, drain=(1 << 20, 0.05))
    assert status == 408 and error["type"] == "timeout_error" and inner.calls == 0
    # a sender too slow in all, still sending: what it sends within the drain's bounds is read, then the 408
    status, _, _, read = through_middleware([b"x"] * 5 + [None], idle=5.0, total=0.0, drain=(1 << 20, 0.05))
    assert status == 408 and len(read) == 5


def test_a_body_within_the_limit_reaches_the_app():
    status, _, inner, _ = through_middleware([b'{"model":', b' "m"}'])
    assert status == 200 and inner.calls == 1


# -- every stream ends -----------------------------------------------------------------------------
class Stream:
    """A generation stream: its chunks, then an exception."""

    def __init__(self, chunks, error):
        self.chunks, self.error = list(chunks), error

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.chunks:
            return self.chunks.pop(0)
        raise self.error

    async def aclose(self):
        pass


def sse_of(streams, firsts) -> list[str]:
    """The SSE events the ingress writes for these streams (deployments/streams.py)."""
    from app.openai.responses import ChoiceView
    from deployments.streams import StreamedChoices, StreamedResponse, sse_events

    tokenizer = SimpleNamespace(decode=lambda ids, **_: "")
    views = [ChoiceView(tokenizer, chat=False, logprobs=False) for _ in streams]

    async def go():
        deadline = asyncio.get_running_loop().time() + 60
        gen = sse_events(StreamedResponse("cmpl-1", "m", False, 1, deadline, 60.0),
                         StreamedChoices(list(range(len(streams))), firsts, streams, views))
        return [event async for event in gen]
    return asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("error", [RuntimeError("bug"), KeyError("x"), ZeroDivisionError()])
def test_any_error_mid_stream_ends_it_with_an_error_event_and_done(error):
    """Before, only APIError was caught: the pump died and the client waited for ever."""
    first = {"token_ids": [5], "text": "a"}
    events = sse_of([Stream([{"token_ids": [6], "text": "b"}], error)], [first])
    assert events[-1] == "data: [DONE]\n\n"
    last = json.loads(events[-2][6:])
    assert last["error"]["type"] == "internal_error" and last["error"]["code"] == 500
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["a", "b"]


def test_a_request_the_target_refuses_mid_stream_is_a_400_event():
    events = sse_of([Stream([], InvalidRequestError("bad top_k", param="top_k"))], [{"token_ids": [5], "text": "a"}])
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] is None and error["param"] == "top_k" and error["type"] == "invalid_request_error"
    assert events[-1] == "data: [DONE]\n\n"


def test_each_api_key_gets_its_own_prefix_cache_scope(tokenizer):
    from app.errors import APIError
    from app.openai.front import FrontSettings, OpenAIFront

    def scope(keys, given):
        front = OpenAIFront(tokenizer, FrontSettings("m", 64, api_keys=tuple(k.encode() for k in keys)))
        return front.authorize({"authorization": f"Bearer {given}"})
    assert scope([], "anything") is None  # no keys: one shared scope
    assert scope(["k1", "k2"], "k1") != scope(["k1", "k2"], "k2")
    assert scope(["k1", "k2"], "k1") == scope(["k1"], "k1")  # the scope is the key's, not its place in the list
    with pytest.raises(APIError) as e:
        scope(["k1", "k2"], "k3")
    assert e.value.status == 401


def test_tiny_temperatures_and_penalties_cannot_overflow_the_logits():
    """A fuzzer's 5e-324 reached the logits: divided by it they overflowed, softmax gave NaN and the
    response's logprobs could not be written as JSON (a 500)."""
    from app.params import MIN_TEMPERATURE

    assert SamplingParams(temperature=5e-324).temperature == MIN_TEMPERATURE  # as vLLM: nearly greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5
    assert refused_param(repetition_penalty=5e-324) == "repetition_penalty"


def test_logprobs_are_always_json_numbers():
    import torch

    from app.speculation.steps import LOGPROB_FLOOR, token_logprobs

    rows = torch.tensor([[float("nan"), 0.0], [float("-inf"), 0.0]])
    (chosen0, top0), (chosen1, _) = token_logprobs(rows, [0, 0], top=2)
    assert chosen0 == chosen1 == LOGPROB_FLOOR and all(lp == lp for _, lp in top0)  # no NaN anywhere
    json.dumps([chosen0, top0], allow_nan=False)


def test_a_null_body_is_read_as_json_and_left_to_the_object_check():
    assert load_json(b"null") is None and load_json(b"[1, [2]]") == [1, [2]]
