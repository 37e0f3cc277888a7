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
    these tools only."""

    start: str = ""
    args_key = "arguments"

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # 1 for a request with parallel_tool_calls false: the first call only

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

    def objects(self, rest: str) -> list:
        return [_loads(block) for block in re.findall(r"<tool_call>(.*?)</tool_call>", rest, flags=re.S)]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = "+" if parallel else ""
        return f'start: ("<tool_call>\\n" call "\\n</tool_call>"){repeat}\n{self.calls_rule(tools)}'


class Llama3Json(Parser):
    start = "{"
    args_key = "parameters"

    def split(self, text: str) -> tuple[str, str]:
        stripped = text.removeprefix("<|python_tag|>").lstrip()
        return ("", stripped) if stripped.startswith("{") else (text, "")

    def objects(self, rest: str) -> list:
        return [_loads(part) for part in re.split(r"\}\s*;\s*\{", rest) if part.strip()] if ";" in rest else [
            _loads(rest)]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n{self.calls_rule(tools)}"


class Mistral(Parser):
    start = "[TOOL_CALLS]"

    def objects(self, rest: str) -> list:
        calls = _loads(rest.removeprefix(self.start))
        return calls if isinstance(calls, list) else [calls]

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        items = {"anyOf": [json.loads(self.call_schema(t)) for t in tools]}
        schema = {"type": "array", "items": items, "minItems": 1, "x-guidance": JSON_LAYOUT}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(schema)}'


PARSERS: dict[str, type[Parser]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


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
    """One streamed choice's text, held back from where a call may begin; its calls at the end."""

    def __init__(self, parser: Parser):
        self.parser, self.text, self.sent = parser, "", 0

    def feed(self, delta: str) -> str:
        """The part of the text so far that is surely content, not yet sent."""
        self.text += delta
        content, rest = self.parser.split(self.text)
        safe = len(content) if rest else len(self.text) - _partial_start(self.text, self.parser.start)
        out, self.sent = self.text[self.sent:max(self.sent, safe)], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) once the choice has finished."""
        content, calls = self.parser.parse(self.text)
        rest = content[self.sent:] if calls else self.text[self.sent:]
        self.sent = len(self.text)
        return rest, calls


def _partial_start(text: str, start: str) -> int:
    """Characters at the end of `text` that could begin `start`."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0
