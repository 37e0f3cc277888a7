"""POST /tokenize and /detokenize, with vLLM's request and response shapes: a prompt's or a chat's
token ids as the server would generate from them, and token ids back to text."""

from pydantic import BaseModel, ConfigDict, Field

from app.errors import InvalidRequestError
from app.openai.chat_template import ChatMessage, TemplateControls, chat_prompt_ids
from app.params import MAX_TOKEN_ID
from app.openai.tool_calls import MAX_TOOLS, Tool

MAX_DETOKENIZE = 1 << 20  # token ids one /detokenize may send (the body limit bounds it first)


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served model (optional).")
    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (a BOS), as completions do.")
    return_token_strs: bool = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(TemplateControls):
    """A chat's ids: the template controls (chat_template, chat_template_kwargs, add_generation_prompt,
    continue_final_message, add_special_tokens) as a chat completion takes them."""

    model: str | None = Field(None, description="The served model (optional).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, through the chat template.")
    return_token_strs: bool = Field(False, description="Also return each token's string.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="Tools offered, rendered by the "
                                                                             "template as a chat completion's are.")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served model (optional).")
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE, description="Token ids to turn into text.")


def tokenize(tokenizer, body: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int) -> dict:
    """{count, max_model_len, tokens, token_strs}: what the server generates from for this prompt or chat."""
    if isinstance(body, TokenizeChatRequest):
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = chat_prompt_ids(tokenizer, body.messages, body, tools=tools)
    else:
        ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids), "token_strs": strs}


def detokenize(tokenizer, body: DetokenizeRequest, vocab_size: int) -> dict:
    """{prompt}: the ids' text, special tokens included."""
    if any(not 0 <= t < min(vocab_size, MAX_TOKEN_ID + 1) for t in body.tokens):
        raise InvalidRequestError(f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, clean_up_tokenization_spaces=False)}
