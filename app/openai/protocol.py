"""OpenAI-compatible request bodies (completions and chat) and the error body; the chat template is
app/openai/chat_template.py, the response bodies are built in app/openai/responses.py."""

import json
import re
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from app.openai.chat_template import ChatMessage, TemplateControls
from app.errors import InvalidRequestError
from app.params import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOPS, MAX_TOKEN_ID, MIN_TOKENS,
                        SamplingFields, SamplingParams, SpeculationParams)
from app.openai.structured import GUIDED, MAX_CHOICE_STRINGS, MAX_PATTERN_CHARS, StructuredOutputs, constraint
from app.openai.tool_calls import MAX_TOOLS, Tool, ToolChoice

MAX_JSON_DEPTH = 64  # nesting of a request body (a JSON schema of 30 nested objects fits)
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # a token id as OpenAI's logit_bias keys write it: ASCII decimal


def load_json(raw: bytes) -> object:
    """A request body's JSON; InvalidRequestError when it is not UTF-8 JSON, holds NaN or Infinity
    (Python's json reads them, JSON has no such numbers) or nests deeper than MAX_JSON_DEPTH."""
    def refuse(constant: str):
        raise InvalidRequestError(f"body is not valid JSON: {constant} is not a JSON number")
    too_deep = InvalidRequestError(f"body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=refuse)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"body is not valid UTF-8 JSON: {e}") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise too_deep
    return data


def json_depth(value: object) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            values = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in values if isinstance(v, (dict, list)))  # scalars add no depth
    return deepest

# Fields that change nothing a client gets back: accepted and dropped.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier"})
# Fields of OpenAI's API, and vLLM's extensions, that this server does not honour yet: accepted only
# at a value that changes nothing, refused otherwise with a 400 naming them; never silently ignored.
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "tools": ([],), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False), "include_stop_str_in_output": (False,),
    "suffix": ("",),
}
WHY_NOT = dict.fromkeys(("tools", "tool_choice"), "for chat completions: a completion makes no tool calls")


def normalise_body(data: dict, model_cls: type[BaseModel]) -> dict:
    """A request body as `model_cls` validates it: an explicit null means the field's default (at
    the top level and inside an object field), harmless fields are dropped, and any other field the
    model does not define is refused with an error naming it, unless it carries its no-op value."""
    out = {}
    for key, value in data.items():
        if value is None or key in HARMLESS_FIELDS:
            continue
        if key in model_cls.model_fields:
            out[key] = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value
        elif key in NO_OP_VALUES:
            if not any(type(value) is type(ok) and value == ok for ok in NO_OP_VALUES[key]):
                allowed = " or ".join(json.dumps(ok) for ok in NO_OP_VALUES[key])
                why = WHY_NOT.get(key, "not supported by this server yet")
                raise InvalidRequestError(f"{key} is {why}: only {allowed} is accepted", param=key)
        else:
            raise InvalidRequestError(f"unknown field {key!r}: this server does not honour it", param=key)
    return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="Send a last chunk with usage (and speculation stats).")
    continuous_usage_stats: bool = Field(False, description="With include_usage: usage so far on every chunk.")


class _Common(SamplingFields):
    """Fields shared by completions and chat completions (bodies pass through normalise_body first);
    the sampling fields that SamplingParams shares are declared once (app/params.py, SamplingFields).
    Every number is bounded and finite here, before anything is built from it."""

    model: str = Field(description="Served model name, as listed by /v1/models.")
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_ID, description="Most tokens to generate (0, on a "
                                                                             "completion with echo: score the prompt).")
    stop: str | list[str] | None = Field(None, description=f"Up to {MAX_STOPS} stop strings of at most "
                                                           f"{MAX_STOP_CHARS} characters.")
    min_tokens: int = Field(0, **MIN_TOKENS)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt, each sampled with its own seed.")
    stream: bool = Field(False, description="Server-sent events, ending with data: [DONE].")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS,
                                         description="Token id (as a decimal string) -> bias in [-100, 100].")
    response_format: dict | None = Field(None, description='{"type": "json_object"} or {"type": "json_schema", '
                                                           '"json_schema": {"name": ..., "schema": {...}}}: the '
                                                           'output follows it.')
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's): a JSON schema, a regex, a choice of strings or a Lark grammar the "
                          "output follows; at most one constraint per request (app/openai/structured.py).")
    guided_json: dict | str | None = Field(None, description="Extension (vLLM's older name): structured_outputs.json.")
    guided_regex: str | None = Field(None, max_length=MAX_PATTERN_CHARS, description="structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICE_STRINGS, description="structured_outputs.choice.")
    guided_grammar: str | None = Field(None, max_length=MAX_PATTERN_CHARS, description="structured_outputs.grammar.")
    speculation: SpeculationParams | None = Field(None, description="Extension: K or speculation off.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS or any(s == "" or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        # str.isdigit() admits "²" and "١", which int() refuses or reads: only ASCII decimal, no leading zero
        bad = next((k for k in v if not TOKEN_ID_KEY.fullmatch(k)), None)
        if bad is not None:
            raise ValueError(f"logit_bias keys must be token ids written in decimal; got {bad[:20]!r}")
        return v

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per output token, or None: no logprobs (each endpoint reads its own fields)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token (completions with echo and logprobs), or None."""
        return None

    def sampling(self, max_tokens: int, default_spec: SpeculationParams, cache_salt: str | None = None
                 ) -> SamplingParams:
        """The request's SamplingParams; `cache_salt`: its prefix-cache scope (the ingress's, from the
        API key and the request's own cache_salt)."""
        shared = {name: getattr(self, name) for name in SamplingFields.model_fields}
        return SamplingParams(**{**shared, "cache_salt": cache_salt}, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=self.stop or [],
                              logit_bias={int(k): b for k, b in self.logit_bias.items()},
                              logprobs=self.top_logprobs_wanted(), prompt_logprobs=self.prompt_logprobs_wanted(),
                              response_format=constraint(self.response_format, self.structured_outputs,
                                                         {name: getattr(self, name) for name in GUIDED}),
                              speculation=self.speculation or default_spec)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text or token ids; or a list of either (a batch: n choices per prompt, in order).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Log-probabilities of each token and of this "
                                                                "many alternatives.")
    echo: bool = Field(False, description="Return the prompt before the completion (with logprobs: the prompt's "
                                          "tokens' too, the first one's null).")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        if v is False:
            return None  # what some clients send for "none"
        if v is True:
            raise ValueError("logprobs takes the number of alternatives per token (0-20)")
        return v

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        if self.max_tokens == 0:  # prompt scoring: the prompt's logprobs are the whole answer (0: none shown)
            return self.logprobs or 0
        return self.logprobs if self.echo else None

    @model_validator(mode="after")
    def _scoring_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 scores the prompt: it needs echo: true")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if len(v) == 0 or (isinstance(v, list) and any(not isinstance(p, int) and len(p) == 0 for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt as text or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class ChatCompletionRequest(_Common, TemplateControls):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools), '
                                                              '"required", or a named function.')
    parallel_tool_calls: bool = Field(True, description="Whether one answer may hold several calls.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    logprobs: bool = Field(False, description="Log-probabilities of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many alternatives per "
                                                                    "token.")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1 on a chat (scoring a prompt is a completion with echo)")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        if v not in (None, "none", "auto") and not info.data.get("tools"):  # tools: declared before
            raise ValueError("tool_choice needs tools")
        return v

    def calling(self) -> bool:
        """Whether tool calls may be made (and read from the output)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict] | None:
        """The tools as chat templates take them, when the model is offered them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.calling() else None

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def default_max_tokens(chat: bool, room: int, completions_default: int, cap: int) -> int:
    """max_tokens of a request that does not say: a completion gets OpenAI's default for completions
    (`limits.default_max_tokens`, 16); a chat runs to the end of the context (OpenAI's and vLLM's
    default there), within the server's cap on max_tokens."""
    return min(room, cap) if chat else min(room, completions_default)


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_seed(seed: int, j: int) -> int:
    """The seed of a request's j-th choice (of n): the request's own seed for the first, and for the
    others splitmix64 of (seed, j) as an int64, so every choice is reproducible and draws its own
    numbers. Each prompt of a batch uses the same seeds, as if it had been sent alone."""
    if j == 0:
        return seed
    mask = (1 << 64) - 1
    x = (seed + j * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x
