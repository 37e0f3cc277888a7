"""Tool calling (app/openai/tool_calls.py): each family's format parsed into OpenAI's tool_calls, streamed
without showing a call as text, and forced by a grammar when a call is required; the forced output
is exact under speculation and its calls are valid against their schemas."""

import json

import jsonschema
import pytest

from app.engine import Engine, EngineSettings
from app.errors import InvalidRequestError
from app.grammar import grammar_of
from app.params import parse_sampling
from app.model.runner import ModelRunner
from app.openai.tool_calls import PARSERS, NamedToolChoice, Tool, ToolStream, enforced_tools, special_markers
from conftest import blend, make_byte_tokenizer, make_model
from test_grammar import constrained_reference

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}})
TIME = Tool.model_validate({"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}},
                                       "required": ["zone"], "additionalProperties": False}}})
WRITTEN = {  # one family's way of writing two calls, after some text
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
                   '{"name": "get_time", "parameters": {"zone": 1}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
               '{"name": "get_time", "arguments": {"zone": 1}}]',
}


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_each_familys_calls_parse_into_openais_tool_calls(family):
    content, calls = PARSERS[family]().parse(WRITTEN[family])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": 1})]
    assert content.rstrip() == ("" if family == "llama3_json" else "Let me check.")
    assert len({c.id for c in calls}) == 2
    plain = "no tools needed, the answer is 4"
    assert PARSERS[family]().parse(plain) == (plain, [])
    # parallel_tool_calls false: what the model wrote past its first call is not a call of the answer
    assert [c.name for c in PARSERS[family](max_calls=1).parse(WRITTEN[family])[1]] == ["get_weather"]


def assemble(deltas: list[dict], calls: dict) -> None:
    """Take tool_calls deltas into {index: [id, name, arguments]}, as a client does."""
    for d in deltas:
        call = calls.setdefault(d["index"], [None, None, ""])
        if "id" in d:
            assert call[0] is None  # a call's id and name come once, first
            call[0], call[1] = d["id"], d["function"]["name"]
        call[2] += d["function"]["arguments"]


def streamed(parser, text: str, cuts) -> tuple[str, dict, bool, int]:
    """(content, calls, whether it called, events with call deltas before the last) of `text` fed in
    pieces ending at `cuts`."""
    stream, shown, calls, early = ToolStream(parser), "", {}, 0
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        content, deltas = stream.feed(text[a:b])
        shown += content
        assert "<tool" not in shown and "[TOOL" not in shown and '"name"' not in shown
        assemble(deltas, calls)
        early += bool(deltas)
    rest, deltas, called = stream.finish()
    assemble(deltas, calls)
    return shown + rest, calls, called, early


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_a_streamed_choice_never_shows_a_call_as_text_and_streams_the_unary_calls(family):
    text = WRITTEN[family]
    shown, calls, called, early = streamed(PARSERS[family](), text, range(3, len(text), 3))  # markers cut anywhere
    whole, want = PARSERS[family]().parse(text)
    assert shown == whole and called
    assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in want]
    assert early > 4  # the calls went out as they were written, not with the last event


CALLS = [  # what models write, awkward parts included, and the (content, calls) the answer reads there
    ('<tool_call>\n{"name": "a", "arguments": {"q": "} { \\" ]", "n": [1, {"x": null}], "t": true}}\n</tool_call>'
     '<tool_call>{"arguments": {"k": -1.5e3}, "name": "b"}</tool_call>',  # braces, escapes in strings; key order
     "", [("a", '{"q": "} { \\" ]", "n": [1, {"x": null}], "t": true}'), ("b", '{"k": -1.5e3}')]),
    ('<tool_call>\n{"name": "a", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("a", '{"q": 1}')]),  # JSON in a string
    ('<tool_call>\n{"name": "a", "arguments": {"q": "cut off mid-way', "", [("a", '{"q": "cut off mid-way')]),
    ('Sure: <tool_call>{"name": "a"}</tool_call> and after', "Sure: ", [("a", "{}")]),
    ('<tool_call>{"nam": "no name"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>', None, []),
]


@pytest.mark.parametrize("text, content, calls", CALLS)
def test_however_a_choice_is_cut_its_stream_assembles_into_the_unary_answer(text, content, calls):
    import random

    parser, rng = PARSERS["hermes"](), random.Random(len(text))
    got, want = parser.parse(text)
    assert (got, [(c.name, c.arguments) for c in want]) == (text if content is None else content, calls)
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, trial % 9 + 1))) if trial else []
        shown, assembled, called, _ = streamed(parser, text, cuts)
        assert shown == got and called == bool(calls)
        assert [(name, args) for _, name, args in assembled.values()] == calls


def test_the_choice_names_the_tools_a_call_must_go_to():
    assert enforced_tools([WEATHER, TIME], "auto") is None and enforced_tools([WEATHER, TIME], "none") is None
    assert enforced_tools([WEATHER, TIME], "required") == [WEATHER, TIME]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    assert enforced_tools([WEATHER, TIME], named) == [TIME]
    with pytest.raises(ValueError):
        enforced_tools([WEATHER], named)


@pytest.fixture(scope="module")
def byte_pair():
    tok = make_byte_tokenizer()
    target = make_model(seed=4, vocab_rows=len(tok))
    return tok, target, blend(target, 7, 0.8)


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_required_or_named_call_is_the_constrained_greedy_output_and_valid(k, family, choice, byte_pair):
    tok, target, draft = byte_pair
    tools = [WEATHER, TIME] if choice == "required" else [TIME]
    parser = PARSERS[family]()
    fmt = {"type": "grammar", "grammar": parser.grammar(tools, parallel=False)}
    engine = Engine(ModelRunner(target, tok), ModelRunner(draft, tok))
    params = dict(temperature=0, max_tokens=80, response_format=fmt, speculation={"num_tokens": k})
    grammar = grammar_of(parse_sampling(params).response_format)
    for r in engine.generate(["call a tool:", "x"], params):
        want = constrained_reference(target, tok, r.prompt_token_ids, grammar, 80)
        assert r.token_ids == [t for t in want if t != tok.eos_token_id][: len(r.token_ids)]
        if r.finish_reason == "stop":  # a whole call: it parses, names an allowed tool, fits its schema
            _, calls = parser.parse(r.text)
            assert len(calls) == 1 and calls[0].name in {t.function.name for t in tools}
            schema = next(t.function.parameters for t in tools if t.function.name == calls[0].name)
            jsonschema.validate(json.loads(calls[0].arguments), schema)


def test_a_draft_that_ignores_the_call_grammar_lowers_acceptance_but_never_changes_the_output(byte_pair,
                                                                                              monkeypatch):
    """The target as its own draft: with the grammar on both sides every proposal passes. Planted bug:
    a draft that ignores the grammar proposes what the call format refuses; the target's mask rejects
    it, so the output stays the forced call, token for token, and only acceptance drops."""
    import app.speculation.drafting as drafting

    tok, target, _ = byte_pair
    engine = Engine(ModelRunner(target, tok), ModelRunner(target, tok), EngineSettings(draft_top_n=0))
    fmt = {"type": "grammar", "grammar": PARSERS["hermes"]().grammar([WEATHER], parallel=False)}
    params = dict(temperature=0, max_tokens=80, response_format=fmt, speculation={"num_tokens": 4})
    masked = engine.generate(["call a tool:", "x"], params)
    monkeypatch.setattr(drafting, "_ruled", lambda grammars, logits, items, drafted: logits)
    unmasked = engine.generate(["call a tool:", "x"], params)
    assert [r.token_ids for r in unmasked] == [r.token_ids for r in masked]
    rate = lambda rs: sum(r.speculation["accepted_tokens"] for r in rs) / sum(  # noqa: E731
        r.speculation["drafted_tokens"] for r in rs)
    assert rate(masked) > 0.97 and rate(unmasked) < rate(masked)


ARCHITECTURES = {"hermes": "qwen2", "llama3_json": "llama3", "mistral": "mistral"}  # who writes calls so


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_a_forced_call_is_exact_on_its_familys_architecture(family):
    """The architecture that writes each format (tiny configs of Qwen2, Llama 3 and Mistral: padded
    embedding rows, llama3 rope and stop ids, a sliding window): a named call, K = 4, is the
    constrained greedy decode."""
    from test_architectures import FAMILIES, VOCAB, build

    tok = make_byte_tokenizer()
    make, target_vocab, draft_vocab = FAMILIES[ARCHITECTURES[family]]
    target = build(make, 2, len(tok) + target_vocab - VOCAB, seed=1)
    draft = build(make, 1, len(tok) + draft_vocab - VOCAB, seed=2)
    parser = PARSERS[family]()
    params = dict(temperature=0, max_tokens=60, speculation={"num_tokens": 4},
                  response_format={"type": "grammar", "grammar": parser.grammar([TIME], parallel=False)})
    grammar = grammar_of(parse_sampling(params).response_format)
    engine = Engine(ModelRunner(target, tok), ModelRunner(draft, tok))
    for r in engine.generate(["call a tool:", "x"], params):
        want = constrained_reference(target, tok, r.prompt_token_ids, grammar, 60)
        assert r.token_ids == [t for t in want if t != tok.eos_token_id][: len(r.token_ids)]
        assert r.speculation["drafted_tokens"] > 0


# chat templates in the shapes of the three families, written for these tests: each renders the tools,
# an assistant's calls and a tool's result its own way
TEMPLATES = {
    "llama3": ("{{ '<|begin_of_text|>' }}{% for m in messages %}{% if m.role == 'user' and loop.last and tools %}"
               "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON "
               "function call.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ m.content }}<|eot_id|>"
               "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}"
               "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}<|eot_id|>"
               "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
               "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2.5": ("{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
                "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.tool_calls %}<|im_start|>assistant\n"
                "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
                "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}"
                "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% else %}"
                "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "mistral": ("<s>{% for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]"
                "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}"
                "[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
                "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ {'call_id': m.tool_call_id, 'content': m.content} | tojson }}"
                "[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"),
}


@pytest.mark.parametrize("shape", sorted(TEMPLATES))
def test_each_familys_template_renders_the_tools_the_calls_and_the_results(shape):
    import copy

    from app.openai.chat_template import chat_prompt_ids
    from app.openai.protocol import ChatCompletionRequest

    tok = copy.deepcopy(make_byte_tokenizer())
    tok.chat_template = TEMPLATES[shape]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Oslo", "unit": "c"}'}}
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER.model_dump()], "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}, {"role": "user", "content": "And?"}]})
    text = tok.decode(chat_prompt_ids(tok, body.messages, tools=body.tool_dicts()))
    assert '"name": "get_weather"' in text and '"maxLength": 12' in text  # the tool, with its schema
    assert '"city": "Oslo"' in text and "12 C" in text  # the call, its arguments as an object, the result
    offered = tok.decode(chat_prompt_ids(tok, body.messages, tools=None))
    assert '"maxLength": 12' not in offered  # tool_choice none: not offered


MARKERS = ["[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|python_tag|>"]  # special tokens in real tokenizers


@pytest.fixture(scope="module")
def marker_pair():
    """The byte-level pair with the formats' markers as special tokens, as Mistral's and Hermes 2
    Pro's tokenizers hold them."""
    import copy

    tok = copy.deepcopy(make_byte_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    target = make_model(seed=4, vocab_rows=len(tok))
    return tok, target, blend(target, 7, 0.8)


def forced_calls(pair, family: str):
    """Greedy calls under `family`'s required-call grammar with its markers as the tokenizer holds them
    (`special_markers`): each output the target's own constrained greedy output, its first token the
    start marker's id, and a finished one a get_weather call. Returns (engine, params, parser, results)."""
    tok, target, draft = pair
    parser = PARSERS[family](specials=special_markers(tok, PARSERS[family]))
    fmt = {"type": "grammar", "grammar": parser.grammar([WEATHER], parallel=False)}
    assert "<[" in fmt["grammar"] and json.dumps(PARSERS[family].start) not in fmt["grammar"]
    params = dict(temperature=0, max_tokens=80, response_format=fmt, speculation={"num_tokens": 4},
                  keep_special_token_ids=sorted(parser.specials.values()))
    grammar = grammar_of(parse_sampling(params).response_format)
    engine = Engine(ModelRunner(target, tok), ModelRunner(draft, tok))
    results = engine.generate(["call a tool:", "x"], params)
    for r in results:
        want = constrained_reference(target, tok, r.prompt_token_ids, grammar, 80)
        assert r.token_ids == [t for t in want if t != tok.eos_token_id][: len(r.token_ids)]
        assert r.token_ids[0] == parser.specials[parser.start]  # the marker is the token itself
        assert r.text.startswith(parser.start) and r.speculation["drafted_tokens"] > 0
        if r.finish_reason == "stop":
            _, calls = parser.parse(r.text)
            assert [c.name for c in calls] == ["get_weather"]
            jsonschema.validate(json.loads(calls[0].arguments), WEATHER.function.parameters)
    assert any(r.finish_reason == "stop" for r in results)
    return engine, params, parser, results


@pytest.mark.parametrize("family", ["mistral", "hermes"])
def test_a_marker_that_is_a_special_token_is_forced_as_that_token_and_kept_in_the_text(family, marker_pair):
    """Before, the grammar spelled `[TOOL_CALLS]` in ordinary tokens (the model's own marker token
    was refused) and the decoded text left special tokens out, so the parser never saw a call."""
    tok = marker_pair[0]
    specials = special_markers(tok, PARSERS[family])
    assert set(specials) == set(PARSERS[family].markers) and all(i >= 300 for i in specials.values())
    engine, params, parser, results = forced_calls(marker_pair, family)
    # the same tokens decoded as requests without tools decode them: the markers left out
    plain = engine.generate(["call a tool:"], {**params, "keep_special_token_ids": []})[0]
    assert plain.token_ids == results[0].token_ids and parser.start not in plain.text


def test_a_marker_that_is_an_added_token_but_not_special_is_forced_as_that_token(tokenizer_with_added_markers):
    """Qwen2.5's `<tool_call>` is an added token that is not special. Before, the grammar spelled it as
    text: llguidance let the model's marker token through the mask, then failed on it, and a required
    call on the real Coder pair came out as `<tool_call>` sixty times over."""
    tok = tokenizer_with_added_markers[0]
    specials = special_markers(tok, PARSERS["hermes"])
    assert set(specials) == {"<tool_call>", "</tool_call>"}
    assert not any(tok.added_tokens_decoder[i].special for i in specials.values())
    _, _, parser, results = forced_calls(tokenizer_with_added_markers, "hermes")
    assert all(r.token_ids.count(specials["<tool_call>"]) == 1 for r in results)


@pytest.fixture(scope="module")
def tokenizer_with_added_markers():
    """The byte-level pair with Hermes' markers as added tokens that are not special (Qwen2.5's kind)."""
    import copy

    tok = copy.deepcopy(make_byte_tokenizer())
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    target = make_model(seed=4, vocab_rows=len(tok))
    return tok, target, blend(target, 7, 0.8)


def test_kept_specials_change_nothing_else_in_the_text(marker_pair):
    """Decoding with markers kept is decoding with special tokens skipped, but for the kept ones;
    skip_special_tokens false shows them all."""
    import random

    from app.params import SamplingParams
    from app.job import GenerationJob
    from app.request import RequestState

    tok = marker_pair[0]
    tc, tag = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "<|python_tag|>"])
    specials = [0, 1, *tok.convert_tokens_to_ids(MARKERS)]
    words = tok.encode('def f(x):\n    return {"name": "ada", "items": [1, 2]} # done', add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(50):  # whole characters only: a cut one is held back until it completes (app/request.py)
        ids = [rng.choice(specials if rng.random() < 0.3 else words) for _ in range(rng.randint(1, 30))]

        def text(**kw):
            params = SamplingParams(max_tokens=64, ignore_eos=True, **kw)
            return RequestState(GenerationJob("r", [5], params, 0, ids), tok, 512).text
        shown = tok.decode([t for t in ids if t == tc or t not in specials], skip_special_tokens=False)
        assert text(keep_special_token_ids=[tc]) == shown
        assert text() == tok.decode(ids, skip_special_tokens=True)
        if tag not in ids:  # a kept special the output lacks changes nothing
            assert text(keep_special_token_ids=[tag]) == text()
        assert text(skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_request_offering_tools_keeps_its_formats_special_markers_in_its_text(choice, marker_pair):
    """With `auto` too: the model may write a call, which its parser must see."""
    from app.openai.front import FrontSettings, OpenAIFront
    from app.openai.protocol import ChatCompletionRequest
    from app.params import SamplingParams

    tok, tc = marker_pair[0], marker_pair[0].convert_tokens_to_ids("[TOOL_CALLS]")
    front = OpenAIFront(tok, FrontSettings("m", 256, tool_call_parser="mistral"))

    def constrained(tools: list[dict]):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "tools": tools, "tool_choice": choice})
        return front._tool_constraint(body, SamplingParams())
    sampling = constrained([WEATHER.model_dump()])
    assert sampling.keep_special_token_ids == [tc] and sampling.skip_special_tokens
    assert (sampling.response_format is None) == (choice == "auto")
    if choice == "required":
        assert sampling.response_format["grammar"].startswith(f"start: <[{tc}]> calls")
        # a schema no grammar compiles: a 400 naming the tools, which the client sent, not a response_format
        bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}}}
        with pytest.raises(InvalidRequestError, match="cannot be forced.*strin") as e:
            constrained([bad])
        assert e.value.param == "tools"


def test_messages_with_calls_and_results_are_checked_as_openai_checks_them():
    from pydantic import ValidationError

    from app.openai.protocol import ChatCompletionRequest

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ask = {"role": "user", "content": "hi"}
    for messages in ([ask, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "r"}],  # no id
                     [ask, {"role": "assistant", "tool_calls": [{"id": 1, "function": "f"}]}],  # not a call
                     [{"role": "user", "content": "hi", "tool_calls": [call]}]):  # calls from a user
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        ask, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]})
    assert body.messages[1].for_template()["tool_calls"] == [{**call, "function": {"name": "f", "arguments": {}}}]
