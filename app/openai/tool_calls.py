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

Both the unary answer and the stream read calls with one scanner (`Parser.calls`, over
app/openai/json_scan.py): a call counts once its name is whole, and its arguments are the JSON text the
model wrote (a JSON string's contents, if it wrote one). A stream sends each call's name as soon
as it is whole and its arguments as they grow, so what a client assembles is the unary answer.

With `tool_choice: "required"` or a named function, the output must be calls in that format: the
parser's grammar (llguidance Lark with each tool's parameters as an embedded JSON schema) masks the
target and the draft alike, like any structured output, so the output stays exact under speculation
(app/grammar.py). With `auto` the model decides and the parser reads what it wrote.

A format's markers are added tokens in some tokenizers (Mistral's `[TOOL_CALLS]`, Hermes 2 Pro's and
Qwen2.5's `<tool_call>`, special or not): decoding would leave special ones out of the text, and a
grammar's literal would spell them in ordinary tokens. So a request offering tools keeps them in its text (SamplingParams'
keep_special_token_ids) and the grammar names the token itself (`<[id]>`): `special_markers`.
"""

import json
import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.openai.json_scan import members, objects, whole_string
from app.openai.structured import JSON_LAYOUT

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


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """A call: whole, or as far as the text goes (its arguments' JSON text so far)."""

    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or new_call_id()

    def body(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def calls_in(rest: str, args_key: str) -> list[tuple[str, str]]:
    """The leading calls in the text where calls begin, as far as it goes, as (name, arguments' JSON
    text): those whose name is whole. Arguments under `args_key` (or "arguments"); a call closed
    without any has "{}"."""
    calls = []
    for start, end in objects(rest):
        found = members(rest, start)
        name = whole_string(rest, found.get("name"))
        if name is None:
            break  # calls go out in order: a later one waits for this one's name
        span = found.get(args_key, found.get("arguments"))
        if span is None:
            arguments = "{}" if end is not None else ""
        elif rest[span[0]] == '"':  # the arguments written as a JSON string of JSON: its contents, once whole
            arguments = whole_string(rest, span) or ""
        else:
            arguments = rest[span[0]:len(rest) if span[1] is None else span[1]]
        calls.append((name, arguments))
    return calls


class Parser:
    """How one family writes tool calls. `start`: where calls begin in the text; `parse(text)` ->
    (content before the calls, calls, at most `max_calls`); `grammar(tools, parallel)`: calls of
    these tools only; `markers`: the strings of the format a tokenizer may hold as special tokens."""

    start: str = ""
    args_key = "arguments"
    markers: tuple[str, ...] = ()

    def __init__(self, max_calls: int | None = None, specials: dict[str, int] | None = None):
        self.max_calls = max_calls  # 1 for a request with parallel_tool_calls false: the first call only
        self.specials = specials or {}  # the markers this tokenizer holds as one added token each: their ids

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

    def calls(self, text: str) -> list[tuple[str, str]]:
        """The calls in a choice's text so far (at most `max_calls`): (name, arguments' JSON text)."""
        _, rest = self.split(text)
        return calls_in(rest, self.args_key)[: self.max_calls] if rest else []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A finished choice's (content before the calls, calls); no calls: the whole text."""
        content, _ = self.split(text)
        calls = [ToolCall(name, arguments) for name, arguments in self.calls(text)]
        return (content if calls else text), calls

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

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = "+" if parallel else ""
        begin, end = map(self.literal, self.markers)
        return f'start: ({begin} "\\n" call "\\n" {end}){repeat}\n{self.calls_rule(tools)}'


class Llama3Json(Parser):
    """The calls are the whole output, perhaps after `<|python_tag|>` (a special token, left out of
    the text unless the request shows special tokens: not a marker the parser needs)."""

    start = "{"
    args_key = "parameters"
    tag = "<|python_tag|>"

    def head(self, text: str) -> str:
        return text.lstrip().removeprefix(self.tag).lstrip()

    def split(self, text: str) -> tuple[str, str]:
        head = self.head(text)
        return ("", head) if head.startswith("{") else (text, "")

    def safe_end(self, text: str) -> int:
        head = self.head(text)  # nothing yet but blanks or the tag, or a call begun: all may be a call
        return 0 if not head or head.startswith("{") or self.tag.startswith(text.lstrip()) else len(text)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n{self.calls_rule(tools)}"


class Mistral(Parser):
    start = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        items = {"anyOf": [json.loads(self.call_schema(t)) for t in tools]}
        schema = {"type": "array", "items": items, "minItems": 1, "x-guidance": JSON_LAYOUT}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: {self.literal(self.start)} calls\ncalls: %json {json.dumps(schema)}'


PARSERS: dict[str, type[Parser]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


def special_markers(tokenizer, parser: type[Parser]) -> dict[str, int]:
    """The format's markers this tokenizer holds as added tokens (special or not), with their ids.

    Not only special ones: llguidance reads every added token as a special one, whose text no grammar
    literal matches. Qwen2.5's `<tool_call>` is added but not special; spelled as a literal, the model's
    own marker token passed the mask and then failed the parser, and a required call came out as the
    marker over and over."""
    added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    return {m: added[m] for m in parser.markers if m in added}


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
    """One streamed choice: its text, held back from where a call may begin, and its calls as they
    are written, as OpenAI's `tool_calls` deltas: a call's id and name once its name is whole, then
    its arguments' text as it grows.

    What has gone out after some text depends on that text alone, not on how it was cut into deltas
    (every rule here reads a prefix of it). So a stream resumed on another ingress replica after a
    failover takes in `sent`, the text the client's events were made of, and goes on from there."""

    def __init__(self, parser: Parser, sent: str = ""):
        self.parser, self.text, self.sent = parser, "", 0
        self.ids: list[str] = []  # per call begun: its id
        self.shown: list[int] = []  # ... and the characters of its arguments sent
        self.feed(sent)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(the text so far that is surely content, not yet sent; the calls' deltas)."""
        self.text += delta
        safe = max(self.sent, self.parser.safe_end(self.text))
        out, self.sent = self.text[self.sent:safe], safe
        return out, self._deltas()

    def finish(self) -> tuple[str, list[dict], bool]:
        """(content not yet sent, the calls' last deltas, whether the choice made calls) once it has finished."""
        deltas = self._deltas()
        content, _ = self.parser.split(self.text)
        rest = (content if self.ids else self.text)[self.sent:]
        self.sent = len(self.text)
        return rest, deltas, bool(self.ids)

    def _deltas(self) -> list[dict]:
        # the call region is read again from its start on each delta: calls are short, and a choice
        # without one (no marker, or text first where a call must be the whole output) has none to read
        out = []
        for i, (name, arguments) in enumerate(self.parser.calls(self.text)):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.shown.append(len(arguments))
                out.append(ToolCall(name, arguments, self.ids[i]).body(i))
            elif len(arguments) > self.shown[i]:
                out.append({"index": i, "function": {"arguments": arguments[self.shown[i]:]}})
                self.shown[i] = len(arguments)
        return out


def _partial_start(text: str, start: str) -> int:
    """Characters at the end of `text` that could begin `start`."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0
