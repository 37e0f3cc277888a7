"""Structured outputs and tool calls over HTTP, as clients send them with the OpenAI SDK, on a pair
whose byte-level tokenizer llguidance reads and whose chat template renders tools in the Hermes/Qwen
shape (served with `tool_call_parser: hermes`), its markers special tokens as in Hermes 2 Pro's:
- each vLLM structured output under its new name (`structured_outputs`) and its old one (`guided_*`):
  the served greedy output is the in-process engine's, and follows the constraint;
- the tool-calling flow: a required or named call, streamed or not, then the tool's result sent back
  through the template for the final answer.
"""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from app.engine import Engine
from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow
CONSTRAINTS = {  # kind -> (structured_outputs value, the older field and its value, a check of the text)
    "regex": ("[a-z]{2,5}=[0-9]{1,3};", lambda text: re.fullmatch("[a-z]{2,5}=[0-9]{1,3};", text)),
    "choice": (["yes", "no", "maybe later"], lambda text: text in ("yes", "no", "maybe later")),
    "grammar": ('start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | /[0-9]+/',
                lambda text: re.fullmatch(r"\(([a-z]+|[0-9]+)(,([a-z]+|[0-9]+))*\)", text)),
}


# a chat template of the Hermes/Qwen 2.5 shape, written for these tests: tools listed in a system
# turn, calls as <tool_call> blocks, tool results as <tool_response> in a user turn
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for call in m.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), byte_level=True, chat_template=TEMPLATE,
                          special_tokens=["<tool_call>", "</tool_call>"])


@pytest.fixture(scope="module")
def url(pair):
    with running_app(*pair, args={"tool_call_parser": "hermes"}, compiled=False) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(pair):
    return Engine.from_pretrained(*pair)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_each_structured_output_under_both_names_is_the_engines_and_follows_it(client, local, kind):
    value, follows = CONSTRAINTS[kind]
    texts = []
    for extra in ({"structured_outputs": {kind: value}}, {f"guided_{kind}": value}):
        r = client.completions.create(model="target", prompt="value: ", max_tokens=24, temperature=0,
                                      extra_body=extra)
        texts.append((r.choices[0].text, r.choices[0].finish_reason))
    want = local.generate("value: ", dict(max_tokens=24, temperature=0, response_format={"type": kind, kind: value}))[0]
    assert texts[0] == texts[1] == (want.text, want.finish_reason)
    if want.finish_reason == "stop":
        assert follows(want.text), want.text


def test_skip_special_tokens_false_shows_them_in_the_text(client):
    """A grammar that forces the special token <tool_call>: left out of the text, or shown."""
    texts = [client.completions.create(model="target", prompt="x", max_tokens=4, temperature=0, extra_body={
        "structured_outputs": {"grammar": 'start: <tool_call> "ab"'}, **skip}).choices[0].text
        for skip in ({}, {"skip_special_tokens": False})]
    assert texts == ["ab", "<tool_call>ab"]


def test_two_constraints_in_one_request_are_a_400_naming_the_second(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="target", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}})
    assert "one output constraint" in str(e.value)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_the_sdks_tool_calling_flow(client, url, choice):
    """Call, tool result, final answer; the streamed call reassembles into the non-streamed one."""
    ask = dict(model="target", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
               max_tokens=120, parallel_tool_calls=False)
    r = client.chat.completions.create(**ask)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    allowed = {"get_weather": WEATHER, "get_time": TIME} if choice == "required" else {"get_time": TIME}
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name]["function"]["parameters"])

    names, pieces, finish = [], [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for c in (delta.tool_calls or []) if delta else []:
            assert c.index == 0
            names += [c.function.name] if c.function.name else []  # the name once, with the call's id
            pieces.append(c.function.arguments or "")
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names == [call.function.name] and "".join(pieces) == call.function.arguments and finish == "tool_calls"
    assert len(pieces) > 2  # the arguments streamed as they were written

    result = {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}
    follow = ASK + [message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(model="target", messages=follow, tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=8, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    # the result went through the template, after the call
    tokens = httpx.post(f"{url}/tokenize", json={"model": "target", "messages": follow}, timeout=30).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert "<tool_response>\n12 degrees\n</tool_response>" in text and call.function.name in text


def test_with_auto_the_model_decides_and_its_calls_are_read(client):
    r = client.chat.completions.create(model="target", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
