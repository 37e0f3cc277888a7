"""Tool calling (app/tools.py): each family's format parsed into OpenAI's tool_calls, streamed
without showing a call as text, and forced by a grammar when a call is required; the forced output
is exact under speculation and its calls are valid against their schemas."""

import json

import jsonschema
import pytest

from app.engine import Engine
from app.grammar import grammar_of
from app.params import parse_sampling
from app.runner import ModelRunner
from app.tools import PARSERS, NamedToolChoice, Tool, ToolStream, enforced_tools
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


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_a_streamed_choice_never_shows_a_call_as_text_and_ends_with_the_same_calls(family):
    text = WRITTEN[family]
    stream, shown = ToolStream(PARSERS[family]()), ""
    for i in range(0, len(text), 3):  # deltas of 3 characters, cutting markers anywhere
        shown += stream.feed(text[i:i + 3])
        assert "<tool" not in shown and "[TOOL" not in shown and '"name"' not in shown
    rest, calls = stream.finish()
    whole, want = PARSERS[family]().parse(text)
    assert shown + rest == whole and [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


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
