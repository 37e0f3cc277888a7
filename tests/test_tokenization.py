"""/tokenize and /detokenize (app/tokenization.py) in vLLM's shapes, without a cluster: the ids are
those generation starts from, for a prompt as completions take it and a chat as chat completions do."""

import copy

import pytest
from pydantic import ValidationError

from app.errors import InvalidRequestError
from app.openai_protocol import ChatMessage, chat_prompt_ids
from app.tokenization import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize,
                              tokenize)

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def test_a_prompt_tokenizes_as_a_completion_takes_it(tokenizer):
    out = tokenize(tokenizer, TokenizeCompletionRequest(prompt="def f"), 512)
    assert out["tokens"] == tokenizer("def f")["input_ids"] and out["count"] == len(out["tokens"]) == 5
    assert out["max_model_len"] == 512 and out["token_strs"] is None
    strs = tokenize(tokenizer, TokenizeCompletionRequest(prompt="ab", return_token_strs=True), 512)
    assert strs["token_strs"] == ["a", "b"]


def test_a_chat_tokenizes_as_a_chat_completion_renders_it(chat_tokenizer):
    messages = [ChatMessage(role="user", content="hi")]
    out = tokenize(chat_tokenizer, TokenizeChatRequest(messages=messages), 512)
    assert out["tokens"] == chat_prompt_ids(chat_tokenizer, messages)
    assert chat_tokenizer.decode(out["tokens"]) == "user: hi\nassistant: "
    open_turn = tokenize(chat_tokenizer, TokenizeChatRequest(messages=messages, add_generation_prompt=False,
                                                            continue_final_message=True), 512)
    assert chat_tokenizer.decode(open_turn["tokens"]) == "user: hi"  # the last message left open
    with pytest.raises(ValidationError):
        TokenizeChatRequest(messages=messages, continue_final_message=True)  # and a generation prompt: which?


def test_a_chat_with_tools_counts_the_tools_the_template_renders(chat_tokenizer):
    """As a chat completion offering them renders them: a client budgets its context with this count."""
    from app.openai_protocol import ChatCompletionRequest

    chat_tokenizer.chat_template = "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}" + TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools})
    out = tokenize(chat_tokenizer, TokenizeChatRequest.model_validate({"messages": body.messages, "tools": tools}), 512)
    assert out["tokens"] == chat_prompt_ids(chat_tokenizer, body.messages, tools=body.tool_dicts())
    assert chat_tokenizer.decode(out["tokens"]).startswith("tool get_time\n")


def test_detokenize_gives_the_text_back_and_refuses_ids_the_model_lacks(tokenizer):
    ids = tokenizer("hello")["input_ids"]
    assert detokenize(tokenizer, DetokenizeRequest(tokens=ids), len(tokenizer)) == {"prompt": "hello"}
    for bad in ([len(tokenizer)], [-1], [2**63]):
        with pytest.raises(InvalidRequestError) as e:
            detokenize(tokenizer, DetokenizeRequest(tokens=bad), len(tokenizer))
        assert e.value.param == "tokens"
