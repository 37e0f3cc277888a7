"""Chat messages as requests send them, and the chat template that turns a conversation into the
prompt's token ids: the model's template or the operator's, with vLLM's request controls over it
(chat_template_kwargs, add_generation_prompt, continue_final_message, a request's own template)."""

import functools
import json
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.errors import InvalidRequestError


class TextPart(BaseModel):
    """One part of a message's content given as a list (what many OpenAI clients send); text only."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only text parts: this server serves text models.")
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str | dict = Field(description="JSON text of the arguments (an object is taken as is).")


class AssistantCall(BaseModel):
    """One of an assistant message's calls, as an answer gave it and a client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = Field(None, description="None only beside an assistant's tool_calls.")
    tool_calls: list[AssistantCall] | None = Field(None, max_length=128, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, max_length=256, description="A tool result: the call it answers.")

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def for_template(self, parts: bool = False) -> dict:
        """The message as the chat template takes it: for a template that iterates a message's content
        (`parts`), a list of text parts (a string content becomes one part); for the others one text,
        the parts joined a line apiece. Calls and call ids as templates read them (arguments parsed)."""
        content = self.content or ""
        if parts:
            items = [TextPart(type="text", text=content)] if isinstance(content, str) else content
            out = {"role": self.role, "content": [{"type": "text", "text": p.text} for p in items]}
        else:
            out = {"role": self.role,
                   "content": content if isinstance(content, str) else "\n".join(p.text for p in content)}
        if self.tool_calls:
            out["tool_calls"] = [template_call(c.model_dump()) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def template_call(call: dict) -> dict:
    """An OpenAI tool call as chat templates read it: the function's arguments as an object."""
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # a template prints what it was given
    return {**call, "function": function}


@functools.lru_cache(maxsize=32)
def iterates_content(template: str) -> bool:
    """Whether a chat template loops over a message's content (OpenAI's list of parts), as templates of
    multimodal families do, rather than printing it as a string: read from the template's syntax tree
    (a `for` whose iterable is some `x.content` or `x['content']`, possibly through filters)."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node) -> bool:
        while isinstance(node, jinja2.nodes.Filter):
            node = node.node
        return (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content") or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content")
    return any(is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


MAX_CHAT_TEMPLATE = 1 << 16  # characters of a chat template a request may bring
MAX_TEMPLATE_KWARGS = 64  # variables a request may pass to the chat template
# names apply_chat_template takes as its own parameters, and the ones the server gives the template:
# a request's template variables may not take them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class TemplateControls(BaseModel):
    """How a chat goes through the chat template: vLLM's request fields for it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    add_generation_prompt: bool = Field(True, description="End with the assistant's turn opened.")
    continue_final_message: bool = Field(
        False, description="Leave the last message open, so the output continues it (an assistant's prefill); "
        "needs add_generation_prompt: false.")
    add_special_tokens: bool = Field(False, description="The tokenizer's special tokens (a BOS) on top of what the "
                                                        "template writes.")
    chat_template: str | None = Field(
        None, max_length=MAX_CHAT_TEMPLATE, description="A Jinja chat template for this request instead of the "
        "model's; refused unless the server trusts request templates (args.trust_request_chat_template).")
    chat_template_kwargs: dict[str, object] | None = Field(
        None, max_length=MAX_TEMPLATE_KWARGS, description="Extra variables for the template, e.g. "
        '{"enable_thinking": false} for templates that read it.')

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v):
        taken = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (a request field or the server's)")
        return v


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], controls: TemplateControls | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """The conversation through the chat template (the request's own, when it brings one and the
    caller allowed it, else the tokenizer's), as token ids: ending with the assistant's turn opened,
    or with the last message left open to be continued; with the tokenizer's special tokens on top
    of what the template writes, when asked.

    A template that refuses the conversation (Gemma's "System role not supported", Mistral's strict
    user/assistant alternation) raises from inside the template: that is the request's fault, a 400
    naming the template's reason, never a 500.
    """
    controls = controls or TemplateControls()
    template = controls.chat_template or tokenizer.chat_template
    try:
        parts = isinstance(template, str) and iterates_content(template)
        out = tokenizer.apply_chat_template([m.for_template(parts) for m in messages],
                                            tokenize=not controls.add_special_tokens, chat_template=template,
                                            add_generation_prompt=controls.add_generation_prompt,
                                            continue_final_message=controls.continue_final_message, tools=tools,
                                            **(controls.chat_template_kwargs or {}))
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"the chat template rejects these messages: {e}", param="messages") from None
    if controls.add_special_tokens:
        return list(tokenizer(out, add_special_tokens=True)["input_ids"])
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
