"""Checkpoints behave as `generate` and chat clients expect: stop ids from the generation config,
detokenisation that never takes back streamed text, chat content given as parts, the chat default
max_tokens, and chat template refusals as the request's error."""

import copy

import pytest
import torch

from app.engine import Engine
from app.errors import InvalidRequestError
from app.openai.chat_template import TemplateControls, chat_prompt_ids
from app.openai.protocol import ChatCompletionRequest, default_max_tokens
from app.params import SamplingParams
from app.job import GenerationJob
from app.request import DETOKENIZE_CONTEXT, RequestState
from app.model.eos import eos_ids
from app.model.runner import ModelRunner
from tests.conftest import blend, make_tokenizer


def greedy(max_tokens: int, **spec) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "speculation": spec or {"num_tokens": 3}}


def test_generation_config_eos_ids_stop_like_generate(target_model, tokenizer):
    """A stop id the generation config lists beside the tokenizer's eos (Llama-3.1's <|eom_id|>)."""
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))
    free = engine.generate("def f(x):", greedy(12))[0].token_ids
    j = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token first emitted at position j
    model = copy.deepcopy(target_model)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, free[j]]
    runner = ModelRunner(model, tokenizer)
    assert runner.eos_ids == {tokenizer.eos_token_id, free[j]}
    out = Engine(runner, ModelRunner(blend(target_model, 7, 0.85), tokenizer)).generate("def f(x):", greedy(12))[0]
    assert out.token_ids == free[:j] and out.finish_reason == "stop"
    # generate stops on it too (and emits it; we do not, as for the tokenizer's eos)
    prompt = torch.tensor([out.prompt_token_ids])
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert ref == free[: j + 1]


def test_eos_ids_without_a_generation_config(tokenizer):
    assert eos_ids(None, tokenizer) == {tokenizer.eos_token_id}


class CountingTokenizer:
    """A tokenizer that cleans up spaces when decoding (many do by default) and records what it decodes."""

    def __init__(self):
        self.inner = make_tokenizer()
        self.eos_token_id = self.inner.eos_token_id
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        self.decoded.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens,
                                 clean_up_tokenization_spaces=clean_up_tokenization_spaces)

    def ids(self, text: str) -> list[int]:
        return self.inner(text, add_special_tokens=False)["input_ids"]


def state(tok: CountingTokenizer, max_tokens: int = 1000, stop: list[str] | None = None) -> RequestState:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop or [])
    return RequestState(GenerationJob("r", tok.ids("x"), params, 0), tok, 4096)


def test_streamed_text_is_never_taken_back():
    """"a ." decoded with clean-up reads "a.": a round boundary after the space must not lose the "."."""
    tok = CountingTokenizer()
    s = state(tok)
    streamed = ""
    for piece in ["a", " ", ".", " b", " ?"]:
        s.append(tok.ids(piece))
        streamed += s.take_delta()
    assert streamed == "a . b ?" == s.text


def test_detokenisation_costs_new_tokens_per_round():
    tok = CountingTokenizer()
    s = state(tok)
    for _ in range(300):
        tok.decoded.clear()
        s.append(tok.ids("ab"))
        assert max(tok.decoded) <= DETOKENIZE_CONTEXT + 2  # not the whole output, every round
    assert s.text == "ab" * 300


def test_stop_strings_across_rounds_with_incremental_text():
    tok = CountingTokenizer()
    s = state(tok, stop=["END"])
    streamed = ""
    for piece in ["one E", "N", "D two"]:
        kept = s.append(tok.ids(piece))
        streamed += s.take_delta()
    assert s.finished and s.finish_reason == "stop" and streamed == "one " and s.text == "one "
    assert kept == tok.ids("D") and tok.inner.decode(s.output_ids) == "one END"


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "target", **body})


def test_chat_content_as_a_list_of_text_parts(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                        {"type": "text", "text": "world"}]}])
    plain = chat(messages=[{"role": "user", "content": "hello\nworld"}])
    assert chat_prompt_ids(tokenizer, parts.messages) == chat_prompt_ids(tokenizer, plain.messages)
    with pytest.raises(ValueError):  # an image part: this server serves text models
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_chat_template_refusal_is_the_requests_error(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    # Gemma's templates refuse a system turn like this
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    body = chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="System role not supported") as e:
        chat_prompt_ids(tokenizer, body.messages)
    assert e.value.param == "messages"


def test_a_chat_without_max_tokens_runs_to_the_context_end():
    assert default_max_tokens(chat=True, room=3000, completions_default=16, cap=4096) == 3000
    assert default_max_tokens(chat=True, room=9000, completions_default=16, cap=4096) == 4096
    assert default_max_tokens(chat=False, room=3000, completions_default=16, cap=4096) == 16


def test_a_mismatched_draft_is_refused_before_the_app_starts(model_dirs, target_model, tmp_path):
    from app.errors import VocabularyMismatchError
    from deployments.application import build_app

    other = make_tokenizer()
    other.add_tokens(["<extra>"])
    target_model.save_pretrained(tmp_path / "draft")
    other.save_pretrained(tmp_path / "draft")
    args = {"target": {"model": model_dirs["target"]}, "draft": {"model": str(tmp_path / "draft")}}
    with pytest.raises(VocabularyMismatchError, match="id 98"):
        build_app(args)
    assert build_app({**args, "draft": {"model": model_dirs["draft"]}}) is not None  # a matching pair builds


@pytest.mark.parametrize("change, param", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),  # below int64
    ({"prompt_ids": [3, 98]}, "prompt_ids"),  # the vocabulary is 98 tokens
    ({"prompt_ids": [3, -1]}, "prompt_ids"),
    ({"output_ids": [5000]}, "output_ids"),
    ({"params": {"max_tokens": 4, "temperature": -1.0}}, "temperature"),
])
def test_a_bad_job_over_the_handle_fails_alone_with_a_typed_error(change, param, target_model, tokenizer):
    """A job as a Serve handle caller builds it: validated where it runs, failing alone, never hanging."""
    import asyncio

    from app.job import GenerationJob

    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))

    def job(**kw) -> GenerationJob:
        return GenerationJob(**{"request_id": "r", "prompt_ids": [3, 4, 5], "params": greedy(6), "seed": 1, **kw})

    async def collect(j) -> list[int]:
        return [t for chunk in [c async for c in engine.run_job(j)] for t in chunk.get("token_ids", [])]

    async def both():
        return await asyncio.wait_for(asyncio.gather(collect(job(request_id="good")), collect(job(**change)),
                                                     return_exceptions=True), timeout=60)

    good, bad = asyncio.run(both())
    assert isinstance(bad, InvalidRequestError) and param in (bad.param or "")
    assert good == asyncio.run(collect(job(request_id="alone"))) and len(good) == 6


def test_a_template_that_iterates_the_parts_gets_them_and_a_string_template_gets_them_joined(tokenizer):
    from app.openai.chat_template import iterates_content

    # the way multimodal families' templates read content (Llama 3.2 Vision, Qwen2-VL): a loop over the parts
    parts_template = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] | selectattr('type', "
                      "'equalto', 'text') %}[{{ p['text'] }}]{% endfor %}\n{% endfor %}")
    string_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert iterates_content(parts_template) and not iterates_content(string_template)
    assert iterates_content("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}")
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = parts_template
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                        {"type": "text", "text": "world"}]}])
    assert tok.decode(chat_prompt_ids(tok, parts.messages, TemplateControls(add_generation_prompt=False))) == "user:[hello][world]"  # trim_blocks eats the newline
    plain = chat(messages=[{"role": "user", "content": "hi"}])  # a string is one part for such a template
    assert tok.decode(chat_prompt_ids(tok, plain.messages, TemplateControls(add_generation_prompt=False))) == "user:[hi]"
    tok.chat_template = string_template
    assert tok.decode(chat_prompt_ids(tok, parts.messages, TemplateControls(add_generation_prompt=False))) == "user: hello\nworld\n"
