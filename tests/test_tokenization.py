"""/tokenize and /detokenize (app/openai/tokenization.py) in vLLM's shapes, without a cluster: the ids are
those generation starts from, for a prompt as completions take it and a chat as chat completions do."""

import copy

import pytest
from pydantic import ValidationError

from app.errors import InvalidRequestError
from app.openai.chat_template import ChatMessage, chat_prompt_ids
from app.openai.tokenization import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize,
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
    from app.openai.protocol import ChatCompletionRequest

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


THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
            "[no thinking] {% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(chat_tokenizer):
    """As Qwen3's template reads enable_thinking: the variable the request passes is the template's."""
    from app.openai.protocol import ChatCompletionRequest

    chat_tokenizer.chat_template = THINKING
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = ChatCompletionRequest.model_validate(chat)
    off = ChatCompletionRequest.model_validate({**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat_tokenizer.decode(chat_prompt_ids(chat_tokenizer, plain.messages, plain)) == "user: hi\nassistant: "
    assert chat_tokenizer.decode(chat_prompt_ids(chat_tokenizer, off.messages, off)) == \
        "user: hi\nassistant: [no thinking] "
    # /tokenize counts what a chat completion would generate from
    out = tokenize(chat_tokenizer, TokenizeChatRequest.model_validate({**chat, "chat_template_kwargs":
                                                                       {"enable_thinking": False}}), 512)
    assert out["tokens"] == chat_prompt_ids(chat_tokenizer, off.messages, off)


def test_a_request_template_and_continue_final_message(chat_tokenizer):
    from app.openai.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two,"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert chat_tokenizer.decode(chat_prompt_ids(chat_tokenizer, body.messages, body)) == \
        "user: count\nassistant: one, two,"  # the assistant's text left open, to be continued
    own = ChatCompletionRequest.model_validate({"model": "m", "messages": messages[:1],
                                                "chat_template": "<<{{ messages[0].content }}>>"})
    assert chat_tokenizer.decode(chat_prompt_ids(chat_tokenizer, own.messages, own)) == "<<count>>"


@pytest.mark.parametrize("body, why", [
    ({"chat_template_kwargs": {"tokenize": False}}, "tokenize"),  # apply_chat_template's own parameter
    ({"chat_template_kwargs": {"messages": []}}, "messages"),  # what the server gives the template
    ({"chat_template_kwargs": {f"k{i}": i for i in range(65)}}, "at most 64"),
    ({"chat_template": "x" * (1 << 16 + 1)}, "at most 65536"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"chat_template_kwargs": []}, "dictionary"),
])
def test_template_controls_out_of_bounds_are_refused(body, why):
    from app.openai.protocol import ChatCompletionRequest

    with pytest.raises(ValidationError, match=why):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def test_a_configured_chat_template_is_a_template_or_a_file(tmp_path):
    from deployments.args import AppConfig

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert AppConfig(chat_template=str(path)).chat_template == str(path)
    assert AppConfig(chat_template=TEMPLATE).chat_template == TEMPLATE
    with pytest.raises(ValidationError, match="neither a Jinja template nor a readable file"):
        AppConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValidationError, match="not a valid Jinja template"):
        AppConfig(chat_template="{% for m in messages %}unclosed")
