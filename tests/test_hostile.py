"""Hostile bodies beside greedy streams, on a live app (issue 24's "done when").

Hypothesis builds request bodies from the schema's real bounds and the values just past them:
huge and negative integers, NaN and Infinity as JSON literals, non-ASCII digits where numbers are
read, JSON nested 10^5 deep, oversized arrays and strings, wrong types, bad UTF-8, and a hostile
`x-specserve-resume` header, on both endpoints, through the proxy and straight to the ingress
replica. A fixed catalogue (every value in every field it names) is sent first, then HOSTILE_CASES
generated bodies, by two threads, while four threads stream greedy completions beside them.

Done when: no answer is a 5xx or lacks OpenAI's error body, every stream ends with `data: [DONE]`,
every greedy stream beside the hostile bodies is token-identical to its undisturbed reference, and
no Serve actor (controller, proxy, replica) was replaced or restarted.

`make fuzz` sends 3000 generated bodies; the suite sends HOSTILE_CASES (default 300).
"""

import collections
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow
CASES = int(os.environ.get("HOSTILE_CASES", "300"))
# a safety bound on the hostile phase, far past its expected length: past it, no new body is sent
PHASE_LIMIT_S = float(os.environ.get("HOSTILE_TIME_S", "1800"))
TIMEOUT = httpx.Timeout(120.0)  # every HTTP call: a request unanswered for this long counts as no answer
ERROR_KEYS = {"message", "type", "param", "code"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_BODY = 1 << 20  # limits.max_body_bytes (cluster/serve_config.yaml)
MAX_TOKENS_CAP = 32  # keeps thousands of accepted hostile bodies short to generate
STREAM_THREADS, SENDER_THREADS = 4, 2
MAX_STREAMS_PER_THREAD = 10_000
REFERENCE_TOKENS = 24


# -- JSON as hostile clients write it ------------------------------------------------------------
class Raw(str):
    """JSON text sent as is: nesting json.dumps would recurse on, duplicate keys."""


def to_json(value, ascii_only: bool = False) -> str:
    """`value` as JSON text; floats NaN/inf become the literals NaN/Infinity/-Infinity (json.dumps'
    default, which strict parsers refuse), Raw pieces are spliced in unchanged."""
    if isinstance(value, Raw):
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k), ensure_ascii=ascii_only)}:{to_json(v, ascii_only)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def nested_list(depth: int) -> Raw:
    return Raw("[" * depth + "1" + "]" * depth)


def nested_object(depth: int) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth)


def nested_schema(depth: int) -> Raw:
    """A valid JSON schema `depth` objects deep: what a grammar compiler walks recursively."""
    return Raw('{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth)


# -- the hostile values --------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
HUGE = [2**63, 2**63 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30), 1e30, -1e30, 2**31, -1]
NON_FINITE = [NAN, INF, -INF]
BOUNDS = [0, 1, 2, 2.0000001, 5e-324, 1e-300, -2.0000001, 10, 10.000001, 20, 21, 32, 33, 64, 65, 97, 98,
          100, 100.0001, -100.0001, 4096, 4097, 1.5]
THOUSAND_DIGITS = "9" * 1000
NUMERIC_STRINGS = ["²", "١٢", "٣", "0x1", "-1", " 1", "01", "1e3", "+1", "1.0", "1_0", "NaN", "Infinity", "",
                   "𝟙", THOUSAND_DIGITS]
BIAS_KEYS = NUMERIC_STRINGS + ["1 ", "0", "5", "97", "98", str(2**63), str(2**64), "-0", "00000000000000000005"]
WRONG_TYPES = ["1", "abc", {}, {"a": 1}, [], [1], None, True, False, [None], {"": None}]
DEEP = [nested_list(1000), nested_object(1000), nested_list(100_000), nested_object(100_000)]
INT_FIELDS = ["max_tokens", "top_k", "n", "seed", "min_tokens"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
OTHER_FIELDS = ["logit_bias", "stop", "stop_token_ids", "response_format", "stream_options", "speculation",
                "logprobs_mode", "ignore_eos", "stream", "model", "user"]
FIELDS = {COMPLETIONS: INT_FIELDS + FLOAT_FIELDS + OTHER_FIELDS + ["prompt", "logprobs", "echo"],
          CHAT: INT_FIELDS + FLOAT_FIELDS + OTHER_FIELDS + ["messages", "logprobs", "top_logprobs",
                                                            "max_completion_tokens"]}
# the failover's resume header: raw JSON (NaN literals), on a streaming request of one choice
RESUME_HEADERS = [
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[NaN,1,1]}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[1,Infinity,1]}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[-Infinity,1,1]}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[1e308,1e308,1e308]}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[1e999,0,0]}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[0,0,0]}]}',
    f'{{"rid":"x","choices":[{{"seed":1,"output_ids":[],"streamed_chars":0,"controller":[{10**30},{10**30},{10**30}]}}]}}',
    f'{{"rid":"x","choices":[{{"seed":{2**64},"output_ids":[],"streamed_chars":0}}]}}',
    f'{{"rid":"x","choices":[{{"seed":{-(2**63) - 1},"output_ids":[],"streamed_chars":0}}]}}',
    f'{{"rid":"x","choices":[{{"seed":1,"output_ids":[{2**63}],"streamed_chars":0}}]}}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[-1],"streamed_chars":0}]}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[5],"streamed_chars":-1}]}',
    f'{{"rid":"x","choices":[{{"seed":1,"output_ids":[5],"streamed_chars":{10**30}}}]}}',
    f'{{"rid":"x","choices":[{{"seed":1,"output_ids":[5],"streamed_chars":{2**63}}}]}}',
    '{"rid":"x","choices":[{"seed":1,"output_ids":[5,6,7],"streamed_chars":3,"done":true}]}',
    '{"rid":"x","choices":[{"seed":1.5,"output_ids":[5.0],"streamed_chars":"3"}]}',
    '{"rid":"x","choices":[{"seed":1},{"seed":2}]}',
    '{"rid":"x","choices":[]}',
    '{"rid":' + nested_object(1000) + ',"choices":[{"seed":1}]}',
    '{"rid":"x","choices":' + nested_list(1000) + "}",
    '{"rid":"x","choices":' + nested_list(10_000) + "}",
    '{"rid":"' + "r" * 4000 + '","choices":[{"seed":1}]}',
    "{", "", "null", "[]", "NaN",
]


# -- a case: one hostile request -----------------------------------------------------------------
@dataclass
class Case:
    label: str  # what is hostile about it, for the report
    path: str
    body: object  # a JSON value (Raw pieces allowed), or bytes sent as they are
    headers: dict = field(default_factory=dict)
    direct: bool = False  # to the ingress replica's own port, past the proxy (and its failover middleware)
    chunked: bool = False  # no Content-Length: the body's size is known only once read

    def content(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return to_json(self.body).encode("utf-8", "surrogatepass")  # a lone surrogate goes out as bytes, not UTF-8

    def shown(self) -> str:
        text = self.content()[:200].decode("utf-8", "replace")
        return f"{self.label} {'direct' if self.direct else 'proxy'} {self.path} {text!r} {self.headers or ''}"[:400]


def base_body(path: str, model: str, stream: bool = False) -> dict:
    if path == COMPLETIONS:
        return {"model": model, "prompt": "def f(x):", "max_tokens": 8, "stream": stream}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}


def with_field(path: str, model: str, name: str, value, stream: bool) -> dict:
    body = base_body(path, model, stream)
    if path == CHAT and name == "top_logprobs":
        body["logprobs"] = True
    body[name] = value
    return body


def named_values(path: str) -> list[tuple[str, str, object]]:
    """(label, field, value): the issue's hostile values in each field it names."""
    out = []
    ints = INT_FIELDS + (["logprobs"] if path == COMPLETIONS else ["top_logprobs", "max_completion_tokens"])
    out += [(f"{name}={v!r:.20}", name, v) for name in ints
            for v in HUGE + NON_FINITE + ["١٢", "²", THOUSAND_DIGITS, 1.5]]
    out += [(f"{name}={v!r:.20}", name, v) for name in FLOAT_FIELDS
            for v in NON_FINITE + [1e30, -1e30, 10**30, "NaN", "١٢"]]
    for v in HUGE + NON_FINITE:
        out += [(f"stop_token_ids=[{v!r:.20}]", "stop_token_ids", [v]),
                (f"logit_bias value {v!r:.20}", "logit_bias", {"5": v})]
        out += [(f"prompt ids [{v!r:.20}]", "prompt", [5, v])] if path == COMPLETIONS else []
    out += [(f"logit_bias key {key!r:.20}", "logit_bias", {key: 1}) for key in BIAS_KEYS]
    out += [("logit_bias '5' and '05'", "logit_bias", {"5": 100, "05": -100}),
            ("logit_bias 2000 entries", "logit_bias", {str(i): 1 for i in range(2000)}),
            ("logit_bias 2000 duplicate keys", "logit_bias", Raw("{" + ",".join(['"5":1'] * 2000) + "}")),
            ("stop 5 strings", "stop", ["a", "b", "c", "d", "e"]), ("stop 100 kB", "stop", ["s" * 100_000]),
            ("n=10^6", "n", 10**6), ("stream_options NaN", "stream_options", {"include_usage": NAN}),
            ("speculation num_tokens 2**64", "speculation", {"num_tokens": 2**64}),
            ("speculation num_tokens NaN", "speculation", {"num_tokens": NAN})]
    out += [(f"{name} wrong type {v!r:.12}", name, v) for name in FIELDS[path] for v in WRONG_TYPES]
    for depth in (1000, 100_000):
        out += [(f"response_format schema depth {depth}", "response_format",
                 {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(depth)}}),
                (f"response_format depth {depth}", "response_format", nested_object(depth)),
                (f"unknown field depth {depth}", "x_unknown", nested_list(depth)),
                (f"user (a harmless field) depth {depth}", "user", nested_list(depth)),
                (f"logit_bias value depth {depth}", "logit_bias", {"5": nested_list(depth)})]
        out += [(f"prompt depth {depth}", "prompt", nested_list(depth))] if path == COMPLETIONS else [
            (f"content depth {depth}", "messages", [{"role": "user", "content": nested_list(depth)}]),
            (f"content parts depth {depth}", "messages",
             [{"role": "user", "content": [{"type": "text", "text": nested_object(depth)}]}])]
    return out


def sized_cases(path: str, model: str) -> list[Case]:
    """Bodies at and over the size limit, with and without a Content-Length."""
    def padded(size: int) -> dict:
        return with_field(path, model, "user", "u" * size, stream=False)
    under, over = MAX_BODY - 300, MAX_BODY + 10
    return [Case("1 MB body", path, padded(under)), Case("1 MB body, chunked", path, padded(under), chunked=True),
            Case("over-limit body", path, padded(over)),
            Case("over-limit body, chunked", path, padded(over), chunked=True),
            # the proxy's failover keeps a body whole before relaying it
            Case("16 MB body", path, padded(16 * MAX_BODY))]


RAW_BODIES = [(b"", "empty body"), (b"\xff\xfe{", "bad UTF-8"), (b'{"model": "\xc3\x28"}', "bad UTF-8 inside"),
              (b"[]", "top level []"), (b"1", "top level 1"), (b'"s"', "top level string"),
              (b"null", "top level null"), (b"NaN", "top level NaN"), (b"{", "truncated"),
              *[(nested(depth).encode(), f"body {nested.__name__} {depth}")
                for nested in (nested_list, nested_object) for depth in (1000, 100_000)]]


def catalogue(model: str) -> list[Case]:
    """Every hostile value the issue names, in every field it names, on both endpoints; every other
    body streamed."""
    cases = []
    for path in (COMPLETIONS, CHAT):
        cases += [Case(label, path, with_field(path, model, name, value, stream=k % 2 == 1))
                  for k, (label, name, value) in enumerate(named_values(path))]
        cases += sized_cases(path, model) + [Case(label, path, raw) for raw, label in RAW_BODIES]
    long_ids = base_body(COMPLETIONS, model) | {"prompt": [5] * 10**5}
    cases += [Case("prompt 10^5 ids", COMPLETIONS, long_ids),
              Case("prompt 10^5 ids outside vocab", COMPLETIONS, long_ids | {"prompt": list(range(10**5))}),
              Case("prompt 10^5 strings", COMPLETIONS, long_ids | {"prompt": ["a"] * 10**5})]
    # through the proxy (whose failover drops a client's resume header) and straight to the ingress
    cases += [Case(f"resume {header[:60]!r}", path, base_body(path, model, stream=True),
                   {"x-specserve-resume": header}, direct=direct)
              for header in RESUME_HEADERS for path in (COMPLETIONS, CHAT) for direct in (False, True)]
    return cases


# -- the generated cases -------------------------------------------------------------------------
def mostly(common, rare, one_in: int):
    """`common`, and `rare` about one draw in `one_in` (last in the list: hypothesis favours the first)."""
    return st.sampled_from([False] * (one_in - 1) + [True]).flatmap(lambda r: rare if r else common)


def numbers():
    """Numbers at and past the schema's bounds; now and then a NaN, an Infinity or a numeric string
    (rarely: a non-finite number anywhere refuses the whole body at the parse, hiding the rest of it)."""
    return mostly(st.one_of(st.sampled_from(BOUNDS), st.sampled_from(HUGE), st.integers(-3, 100), st.floats(-5, 5)),
                  st.one_of(st.sampled_from(NON_FINITE + NUMERIC_STRINGS), st.integers(), st.floats()), one_in=8)


def texts():
    return st.text(st.characters(codec="utf-8"), max_size=12)


def anything():
    """Hostile values of any field: numbers past their bounds, and less often wrong types and deep nesting."""
    return mostly(numbers(), st.one_of(st.sampled_from(WRONG_TYPES), st.sampled_from(DEEP), texts()), one_in=6)


def field_values(name: str):
    """Values of `name`: mostly shaped like the field, with hostile parts; anything now and then."""
    shaped = {
        "logprobs": st.one_of(st.booleans(), st.integers(-1, 21)),
        "top_logprobs": st.integers(-1, 21),
        **dict.fromkeys(["echo", "ignore_eos", "stream"], st.booleans()),
        "logit_bias": st.one_of(st.dictionaries(mostly(st.integers(0, 97).map(str),
                                                       st.one_of(st.sampled_from(BIAS_KEYS), texts()), one_in=4),
                                                numbers(), max_size=6),
                                st.just({str(i): 1 for i in range(2000)})),
        "stop": st.one_of(st.lists(texts(), max_size=5), st.just(["s" * 100_000]), texts()),
        "stop_token_ids": st.lists(numbers(), max_size=6),
        "prompt": st.one_of(st.lists(numbers(), min_size=1, max_size=4), st.lists(st.integers(0, 97), max_size=8),
                            st.lists(st.lists(numbers(), max_size=3), max_size=3), st.just([5] * 10**5), texts()),
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": st.one_of(texts(), st.lists(st.fixed_dictionaries(
                {"type": st.just("text"), "text": st.one_of(texts(), anything())}), max_size=3))}), max_size=3),
        "response_format": st.one_of(
            st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": NAN},
                             {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(1000)}},
                             {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(100_000)}},
                             {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": NAN}}},
                             {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                                                "maxLength": 2**64}}}]),
            st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                {"schema": st.fixed_dictionaries({"type": st.sampled_from(["integer", "number", "array"]),
                                                  "minimum": numbers(), "maxItems": numbers()})})})),
        "speculation": st.fixed_dictionaries({"num_tokens": st.one_of(numbers(), st.just("auto")),
                                              "enabled": st.one_of(st.booleans(), anything())}),
        "stream_options": st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), anything())}),
        "logprobs_mode": st.sampled_from(["raw", "processed", "x", NAN]),
    }
    return mostly(shaped[name], anything(), one_in=4) if name in shaped else anything()


@st.composite
def generated_case(draw, model: str) -> Case:
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    stream = draw(st.booleans())
    body = base_body(path, model, stream)
    changed = []
    for _ in range(draw(st.integers(1, 4))):
        # an unknown field is refused before anything else is read: few bodies have one
        name = draw(mostly(st.sampled_from(FIELDS[path]), texts(), one_in=16))
        body[name] = draw(field_values(name))
        changed.append(name)
    headers = {}
    if stream and draw(st.integers(0, 3)) == 0:
        resume = draw(st.one_of(st.sampled_from(RESUME_HEADERS), st.fixed_dictionaries({
            "rid": st.one_of(texts(), anything()), "choices": st.lists(st.fixed_dictionaries({
                "seed": numbers(), "ids": st.lists(numbers(), max_size=4), "chars": numbers(),
                "ctl": st.one_of(st.none(), st.lists(numbers(), max_size=4))}), max_size=2)}).map(
            lambda v: to_json(v, ascii_only=True))))
        headers = {"x-specserve-resume": resume}
        changed.append("resume")
    return Case("+".join(map(str, changed))[:60], path, body, headers, direct=draw(st.booleans()),
                chunked=draw(st.integers(0, 9)) == 0)


def generate(model: str, count: int) -> list[Case]:
    """`count` cases as hypothesis draws them (every kind of value, mixed; no shrinking: the whole
    report is kept)."""
    cases = []

    @given(case=generated_case(model))
    @settings(max_examples=count, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def collect(case):
        cases.append(case)

    collect()
    return cases[:count]


# -- answers -------------------------------------------------------------------------------------
def strict_json(text: str):
    """JSON as every client parses it: NaN and Infinity are not JSON."""
    def refuse(literal):
        raise ValueError(f"{literal} is not JSON")
    return json.loads(text, parse_constant=refuse)


def error_fault(body) -> str | None:
    """What is wrong with an {"error": ...} body, or None."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or not isinstance(error["message"], str):
        return "not OpenAI's error body"
    code = error["code"]
    if error["type"] == "internal_error" or (isinstance(code, int) and code >= 500):
        return f"a server error ({error['type']}, code {code})"
    return None


def stream_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def fault(response: httpx.Response) -> str | None:
    """What is wrong with an answer to a hostile body, or None: a success (a completion, or a stream
    of chunks, or an error event, ending with [DONE]) or a 4xx with OpenAI's error body."""
    status = response.status_code
    if status >= 500:
        return f"status {status}"
    try:
        if status >= 400:
            return error_fault(strict_json(response.text))
        if status != 200:
            return f"status {status}"
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return None if "choices" in strict_json(response.text) else "a 200 without choices"
        events = stream_events(response.text)
        if not events or events[-1] != "[DONE]":
            return "stream does not end with data: [DONE]"
        for event in map(strict_json, events[:-1]):
            if "error" in event:
                return error_fault(event) and f"stream error event: {error_fault(event)}"
            if "choices" not in event:
                return "an event that is neither a chunk nor an error"
    except ValueError as e:
        return f"not JSON ({e})"
    return None


@dataclass
class Tally:
    """What the hostile senders saw."""

    statuses: collections.Counter = field(default_factory=collections.Counter)
    params: collections.Counter = field(default_factory=collections.Counter)
    faults: list = field(default_factory=list)  # (fault, case, status, response text)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, case: Case, response: httpx.Response | None, problem: str | None) -> None:
        with self.lock:
            self.sent += 1
            status = response.status_code if response is not None else "none"
            self.statuses[status] += 1
            if response is not None and 400 <= response.status_code < 500:
                try:
                    self.params[strict_json(response.text)["error"]["param"]] += 1
                except (ValueError, KeyError, TypeError):
                    pass
            if problem:
                self.faults.append((problem, case.shown(), status, response.text[:300] if response is not None else ""))


def send(client: httpx.Client, urls: dict, case: Case) -> tuple[httpx.Response | None, str | None]:
    content = case.content()
    headers = {"content-type": "application/json", **case.headers}
    try:
        response = client.post(urls["direct" if case.direct else "proxy"] + case.path, headers=headers,
                                content=iter([content]) if case.chunked else content, timeout=TIMEOUT)
    except httpx.HTTPError as e:
        return None, f"no answer ({type(e).__name__}: {e})"
    return response, fault(response)


# -- greedy streams ------------------------------------------------------------------------------
REFERENCE_PROMPTS = [(COMPLETIONS, {"prompt": "def f(x):\n    return"}), (COMPLETIONS, {"prompt": "The quick brown"}),
                     (CHAT, {"messages": [{"role": "user", "content": "hello there"}]}),
                     (COMPLETIONS, {"prompt": [5, 6, 7, 8, 9]})]


def greedy_stream(client: httpx.Client, url: str, model: str, prompt: tuple[str, dict]) -> str:
    """A greedy stream's text and finish reason; a description of what went wrong if it did."""
    path, fields = prompt
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": REFERENCE_TOKENS,
            "ignore_eos": True, **fields}
    try:
        response = client.post(url + path, json=body, timeout=TIMEOUT)
    except httpx.HTTPError as e:
        return f"<no answer: {type(e).__name__}>"
    if response.status_code != 200:
        return f"<status {response.status_code}: {response.text[:200]}>"
    events = stream_events(response.text)
    if not events or events[-1] != "[DONE]":
        return f"<no [DONE]: {response.text[-200:]!r}>"
    text, finish = [], None
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            return f"<error event: {event['error']}>"
        for choice in event["choices"]:
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return f"{''.join(text)!r} ({finish})"


@dataclass
class Beside:
    """The greedy streams run beside the hostile bodies, and how each compared with its reference."""

    count: int = 0
    identical: int = 0
    differing: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream_beside(url: str, model: str, reference: list[str], offset: int, stop: threading.Event,
                  deadline: float, beside: Beside) -> None:
    """Repeat the reference streams until the hostile phase ends (one at least), comparing each."""
    with httpx.Client() as client:
        for k in range(MAX_STREAMS_PER_THREAD):
            if k and (stop.is_set() or time.monotonic() > deadline):
                return
            i = (offset + k) % len(REFERENCE_PROMPTS)
            got = greedy_stream(client, url, model, REFERENCE_PROMPTS[i])
            with beside.lock:
                beside.count += 1
                if got == reference[i]:
                    beside.identical += 1
                else:
                    beside.differing.append((i, reference[i], got))


def send_hostile(urls: dict, cases: list[Case], next_case, deadline: float, tally: Tally) -> None:
    with httpx.Client() as client:
        while time.monotonic() < deadline and (i := next_case()) is not None:
            response, problem = send(client, urls, cases[i])
            tally.record(cases[i], response, problem)


# -- the cluster ---------------------------------------------------------------------------------
def serve_actors() -> dict[str, tuple]:
    """Every live Serve actor (controller, proxies, replicas): name -> (actor id, pid, restarts). A
    replica that dies is replaced under a new name, a proxy under a new id, the controller is restarted
    in place (a new pid). From the GCS's actor table: the state API needs the dashboard, which the
    local cluster does not start."""
    import ray._private.state

    return {a["Name"]: (a["ActorID"], a["Pid"], a["NumRestarts"]) for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and a["Name"].startswith("SERVE_")}


def per_deployment(actors: dict) -> dict[str, int]:
    """Live actors per deployment (replicas), proxy and controller."""
    return dict(collections.Counter(name.split("#")[1] if "#" in name else name.split("-")[0] for name in actors))


def direct_url(actors: dict) -> str:
    """The ingress replica's own HTTP server (Serve's direct ingress): a listening port of its process
    that answers /health."""
    [pid] = [pid for name, (_, pid, _) in actors.items() if "#Ingress#" in name]
    ports = sorted(c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN)
    for port in ports:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json() == {"status": "ok"}:
                return f"http://127.0.0.1:{port}"
        except (httpx.HTTPError, ValueError):
            continue
    raise AssertionError(f"the ingress replica (pid {pid}) answers /health on none of its ports {ports}")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    # fixed replica counts: a replica added or removed by the autoscaler would read as a restart
    fixed = {"autoscaling_config": None, "num_replicas": 1}
    with running_app(*pair, args={"limits": {"max_tokens_cap": MAX_TOKENS_CAP}},
                     deployments={"DraftServer": fixed, "TargetServer": fixed}, compiled=False) as url:
        model = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
        yield {"proxy": url, "direct": direct_url(serve_actors())}, model


# -- the test ------------------------------------------------------------------------------------
def test_hostile_bodies_beside_greedy_streams(app):
    urls, model = app
    cases = catalogue(model)
    named = len(cases)
    cases += generate(model, CASES)
    with httpx.Client() as client:
        reference = [greedy_stream(client, urls["proxy"], model, p) for p in REFERENCE_PROMPTS]
    assert all(not r.startswith("<") for r in reference), reference
    before = serve_actors()
    tally, beside = hostile_phase(urls, model, cases, reference)
    after = serve_actors()

    print(f"\n[hostile] {tally.sent} of {len(cases)} cases sent ({named} catalogued + {len(cases) - named} "
          f"generated), statuses {dict(sorted(tally.statuses.items(), key=str))}, "
          f"400s by param {dict(tally.params.most_common(12))}, "
          f"streams beside {beside.count} ({beside.identical} identical), "
          f"replicas before {per_deployment(before)} after {per_deployment(after)}")
    report(tally, beside, before, after)
    assert not tally.faults, f"{len(tally.faults)} bad answers, the first: {tally.faults[:3]}"
    assert beside.count >= STREAM_THREADS and not beside.differing, beside.differing[:3]
    assert after == before, f"Serve actors replaced or restarted: before {before}, after {after}"


def hostile_phase(urls: dict, model: str, cases: list[Case], reference: list[str]) -> tuple[Tally, Beside]:
    """Two threads send the cases while four repeat the greedy streams, until every case is sent."""
    tally, beside, stop = Tally(), Beside(), threading.Event()
    deadline = time.monotonic() + PHASE_LIMIT_S
    order, lock = iter(range(len(cases))), threading.Lock()

    def next_case() -> int | None:
        with lock:
            return next(order, None)

    streams = [threading.Thread(target=stream_beside, args=(urls["proxy"], model, reference, k, stop, deadline,
                                                            beside)) for k in range(STREAM_THREADS)]
    senders = [threading.Thread(target=send_hostile, args=(urls, cases, next_case, deadline, tally))
               for _ in range(SENDER_THREADS)]
    for t in streams + senders:
        t.start()
    for t in senders:
        t.join()
    stop.set()
    for t in streams:
        t.join()
    return tally, beside


def report(tally: Tally, beside: Beside, before: dict, after: dict) -> None:
    """Each distinct fault once, with its count and first body; streams that differed; actors changed."""
    kinds = collections.defaultdict(list)
    for problem, shown, status, text in tally.faults:
        kinds[(problem, status, re.sub(r"[0-9a-f]{32}", "<id>", text[:160]))].append(shown)
    for (problem, status, text), shown in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        print(f"[hostile] FAULT x{len(shown)}: {problem} | {status} {text!r} | first: {shown[0]}")
    differing = collections.Counter(beside.differing)
    for (i, want, got), count in differing.most_common(10):
        print(f"[hostile] STREAM x{count}: prompt {i} wants {want[:80]}, got {got[:160]}")
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            print(f"[hostile] ACTOR {name}: before {before.get(name)} after {after.get(name)}")


# -- refusals a client can read ------------------------------------------------------------------
BIG = 40 << 20  # a body 40 times the limit


def _error_of(status: int, body: bytes) -> dict:
    assert status == 413, (status, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"
    return error


def test_oversized_bodies_get_a_readable_413_from_every_client(app):
    """A client that sends its whole body before reading the answer reads the 413 and OpenAI's body
    (before, the proxy answered and closed on the unread body: a reset or a broken pipe), for a
    declared length and a chunked body; one that asks `Expect: 100-continue` gets it before sending;
    the OpenAI SDK makes one attempt (a connection error it would have retried twice)."""
    import http.client
    import socket
    from urllib.parse import urlsplit

    import openai

    urls, model = app
    host, port = urlsplit(urls["proxy"]).hostname, urlsplit(urls["proxy"]).port
    body = json.dumps({"model": model, "prompt": "x" * BIG}).encode()
    for path in (COMPLETIONS, "/tokenize"):
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        _error_of(response.status, response.read())
        conn.close()
    conn = http.client.HTTPConnection(host, port, timeout=120)  # chunked: no length declared
    conn.request("POST", COMPLETIONS, body=(body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)),
                 headers={"content-type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    _error_of(response.status, response.read())
    conn.close()
    r = httpx.post(f"{urls['proxy']}{COMPLETIONS}", content=body, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    _error_of(r.status_code, r.content)
    with socket.create_connection((host, port), timeout=30) as s:  # the answer comes before the body
        s.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413"), head[:100]
    attempts = []
    with httpx.Client(event_hooks={"request": [attempts.append]}, timeout=TIMEOUT) as http_client:
        sdk = openai.OpenAI(base_url=f"{urls['proxy']}/v1", api_key="none", http_client=http_client)
        for kwargs in ({"prompt": "x" * BIG}, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(300_000)}}):
            attempts.clear()
            try:
                sdk.completions.create(model=model, max_tokens=1, **kwargs)
                raise AssertionError("an oversized body was accepted")
            except openai.APIStatusError as e:
                assert e.status_code == 413 and e.body["type"] == "invalid_request_error", e
            assert len(attempts) == 1  # a 413 is not retried; a reset connection was, twice
    assert httpx.get(f"{urls['proxy']}/health", timeout=TIMEOUT).status_code == 200
