"""OpenAI-compatible request and response bodies (completions and chat), plus the error body."""

import json
import time
import uuid
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.errors import InvalidRequestError
from app.params import SamplingParams, SpeculationParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="Send a last chunk with usage (and speculation stats).")


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str = Field(description="Served model name, as listed by /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = all.")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = Field(None, ge=0, le=2**62, description="Reproducible sampling.")
    n: int = Field(1, ge=1, le=1, description="Choices per request; only 1 is supported.")
    stream: bool = Field(False, description="Server-sent events, ending with data: [DONE].")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")
    logprobs: None = Field(None, description="Not supported: must be absent or null.")
    speculation: SpeculationParams | None = Field(None, description="Extension: K or speculation off.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(s == "" for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling(self, max_tokens: int, default_spec: SpeculationParams) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop=self.stop or [], seed=self.seed, ignore_eos=self.ignore_eos,
                              speculation=self.speculation or default_spec)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] = Field(description="Text, or token ids.")
    echo: Literal[False] = Field(False, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    """One part of a message's content given as a list (what many OpenAI clients send); text only."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only text parts: this server serves text models.")
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def for_template(self) -> dict:
        """The message as chat templates take it: parts joined into one text, a line apiece."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """The conversation through the tokenizer's chat template, as token ids.

    A template that refuses the conversation (Gemma's "System role not supported", Mistral's strict
    user/assistant alternation) raises from inside the template: that is the request's fault, a 400
    naming the template's reason, never a 500.
    """
    try:
        ids = tokenizer.apply_chat_template([m.for_template() for m in messages], add_generation_prompt=True,
                                            tokenize=True)
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"the model's chat template rejects these messages: {e}", param="messages") from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")


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


def completion_body(rid: str, model: str, text: str, finish: str | None, usage: dict | None,
                    speculation: dict | None, chat: bool, delta: bool) -> dict:
    """A completion (or one streamed chunk of it), text or chat flavour."""
    if chat:
        choice = {"index": 0, ("delta" if delta else "message"): {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk" if delta else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    if speculation is not None:
        body["speculation"] = speculation
    return body


def sse_event(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body)}\n\n"
