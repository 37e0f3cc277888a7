"""Tool calling: the request's tools and tool_choice, how each model family writes a call, and the
grammar that makes the model call one when it must.

A model is prompted with the tools through its chat template (transformers' `tools=`), and writes a
call in its family's own format; a parser chosen in the server's config (`tool_call_parser`) turns
the output into OpenAI's `tool_calls`:
- `hermes` (Hermes, Qwen 2.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block
  per call;
- `llama3_json` (Llama 3.1-3.3): the output is `{"name": ..., "parameters": {...}}`, calls joined by
  `; `;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

With `tool_choice: "required"` or a named function, the output must be calls in that format: the
parser's grammar (llguidance Lark with each tool's parameters as an embedded JSON schema) masks the
target and the draft alike, like any structured output, so the output stays exact under speculation
(app/grammar.py). With `auto` the model decides and the parser reads what it wrote.

A format's markers are special tokens in some tokenizers (Mistral's `[TOOL_CALLS]`, Hermes 2 Pro's
`<tool_call>`): decoding would leave them out of the text and a grammar's literal would spell them
in ordinary tokens. So a request offering tools keeps them in its text (SamplingParams'
keep_special_token_ids) and the grammar names the token itself (`<[id]>`): `special_markers`.
"""

import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.structured import JSON_LAYOUT

MAX_TOOLS = 128


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, max_length=1 << 14)
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}},
                             description="A JSON schema of its arguments.")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: Function


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{secrets.token_hex(12)}"

    def body(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class Parser:
    """How one family writes tool calls. `start`: where calls begin in the text; `parse(text)` ->
    (content before the calls, calls, at most `max_calls`); `grammar(tools, parallel)`: calls of
    these tools only; `markers`: the strings of the format a tokenizer may hold as special tokens;
    `anywhere`: whether calls may follow text (else a call is the whole output)."""

    start: str = ""
    args_key = "arguments"
    markers: tuple[str, ...] = ()
    anywhere = True

    def __init__(self, max_calls: int | None = None, specials: dict[str, int] | None = None):
        self.max_calls = max_calls  # 1 for a request with parallel_tool_calls false: the first call only
        self.specials = specials or {}  # the markers this tokenizer holds as one special token each: their ids

    def literal(self, marker: str) -> str:
        """A marker in a Lark grammar: the special token by its id where the tokenizer has one, else its text."""
        return f"<[{self.specials[marker]}]>" if marker in self.specials else json.dumps(marker)

    def safe_end(self, text: str) -> int:
        """How much of `text` (a choice's text so far) is surely content, whatever comes next."""
        content, rest = self.split(text)
        return len(content) if rest else len(text) - _partial_start(text, self.start)

    def split(self, text: str) -> tuple[str, str]:
        at = text.find(self.start)
        return (text, "") if at < 0 else (text[:at], text[at:])

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, rest = self.split(text)
        calls = [c for c in map(lambda o: _call(o, self.args_key), self.objects(rest)) if c is not None]
        return (content if calls else text), calls[: self.max_calls]

    def objects(self, rest: str) -> list:
        raise NotImplementedError

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        raise NotImplementedError

    def calls_rule(self, tools: list[Tool]) -> str:
        """Lark rules: `call`, one call of any of the tools, each through its embedded JSON schema."""
        bodies = "\n".join(f"body{i}: %json {self.call_schema(t)}" for i, t in enumerate(tools))
        return f"call: {' | '.join(f'body{i}' for i in range(len(tools)))}\n{bodies}"

    def call_schema(self, tool: Tool) -> str:
        """One call of `tool` as a JSON schema, laid out as json.dumps writes it."""
        schema = {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                   self.args_key: tool.function.parameters},
                  "required": ["name", self.args_key], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
        return json.dumps(schema)


class Hermes(Parser):
    start = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    def objects(self, rest: str) -> list:
        return [_loads(block) for block in re.findall(r"<tool_call>(.*?)</tool_call>", rest, flags=re.S)]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = "+" if parallel else ""
        begin, end = map(self.literal, self.markers)
        return f'start: ({begin} "\\n" call "\\n" {end}){repeat}\n{self.calls_rule(tools)}'


class Llama3Json(Parser):
    """The calls are the whole output, perhaps after `<|python_tag|>` (a special token, left out of
    the text unless the request shows special tokens: not a marker the parser needs)."""

    start = "{"
    args_key = "parameters"
    anywhere = False
    tag = "<|python_tag|>"

    def head(self, text: str) -> str:
        return text.lstrip().removeprefix(self.tag).lstrip()

    def split(self, text: str) -> tuple[str, str]:
        head = self.head(text)
        return ("", head) if head.startswith("{") else (text, "")

    def safe_end(self, text: str) -> int:
        head = self.head(text)  # nothing yet but blanks or the tag, or a call begun: all may be a call
        return 0 if not head or head.startswith("{") or self.tag.startswith(text.lstrip()) else len(text)

    def objects(self, rest: str) -> list:
        return [_loads(part) for part in re.split(r"\}\s*;\s*\{", rest) if part.strip()] if ";" in rest else [
            _loads(rest)]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n{self.calls_rule(tools)}"


class Mistral(Parser):
    start = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)

    def objects(self, rest: str) -> list:
        calls = _loads(rest.removeprefix(self.start))
        return calls if isinstance(calls, list) else [calls]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        items = {"anyOf": [json.loads(self.call_schema(t)) for t in tools]}
        schema = {"type": "array", "items": items, "minItems": 1, "x-guidance": JSON_LAYOUT}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: {self.literal(self.start)} calls\ncalls: %json {json.dumps(schema)}'


PARSERS: dict[str, type[Parser]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


def special_markers(tokenizer, parser: type[Parser]) -> dict[str, int]:
    """The format's markers this tokenizer holds as special tokens, with their ids."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    specials = {t.content: i for i, t in added.items() if getattr(t, "special", False)}
    return {m: specials[m] for m in parser.markers if m in specials}


def _loads(text: str) -> object:
    """One call's JSON as the model wrote it; a fragment (split parallel calls, cut output) is repaired
    by its missing braces at most, else it is no call."""
    text = text.strip()
    for candidate in (text, "{" + text, text + "}", "{" + text + "}"):
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    return None


def enforced_tools(tools: list[Tool], choice: ToolChoice | None) -> list[Tool] | None:
    """The tools a call must be made to (required: any; named: that one), or None when the model may
    answer in text."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return named
    return tools if choice == "required" else None


class ToolStream:
    """One streamed choice's text, held back from where a call may begin; its calls at the end.

    `after`: characters of the choice's text already sent by an ingress before this one (a stream
    resumed after failover; deployments/streams.py reports what was sent, not what was held, so the
    held text comes again). Held text holds the first call's start, so the text from `after` on
    reads as the whole text would; but where a call must be the whole output, text sent means none."""

    def __init__(self, parser: Parser, after: int = 0):
        self.parser, self.text, self.sent = parser, "", 0
        self.plain = after > 0 and not parser.anywhere

    def feed(self, delta: str) -> str:
        """The part of the text so far that is surely content, not yet sent."""
        self.text += delta
        safe = len(self.text) if self.plain else self.parser.safe_end(self.text)
        out, self.sent = self.text[self.sent:max(self.sent, safe)], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) once the choice has finished."""
        content, calls = (self.text, []) if self.plain else self.parser.parse(self.text)
        rest = content[self.sent:] if calls else self.text[self.sent:]
        self.sent = len(self.text)
        return rest, calls


def _partial_start(text: str, start: str) -> int:
    """Characters at the end of `text` that could begin `start`."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0
