"""The OpenAI front end (app/openai/front.py) built directly, without Ray or HTTP: a request parsed,
prepared as jobs, run by an in-process engine and written as OpenAI's response; its refusals in
OpenAI's terms."""

import asyncio
import copy
import json

import pytest

from app.engine import Engine
from app.errors import APIError
from app.openai.front import FrontSettings, OpenAIFront
from app.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.params import MAX_CHOICES, SamplingParams
from app.model.runner import ModelRunner
from tests.conftest import make_model

CONTEXT = 96


@pytest.fixture(scope="module")
def front(tokenizer):
    # a copy: the front sets the tokenizer's chat template, and the session's tokenizer has none
    return OpenAIFront(copy.deepcopy(tokenizer), FrontSettings("m", CONTEXT, max_tokens_cap=40, max_body_bytes=4096))


@pytest.fixture(scope="module")
def engine(target_model, tokenizer):
    return Engine(ModelRunner(target_model, tokenizer), ModelRunner(make_model(seed=2), tokenizer))


def raw(**body) -> bytes:
    return json.dumps({"model": "m", **body}).encode()


def refusal(call) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    return e.value


def run(engine: Engine, front: OpenAIFront, body, chat: bool) -> dict:
    """What a host does with the front: prepare, run each job, render its chunks, write the response."""
    prepared = front.prepare(body, chat)

    async def one(job, view):
        texts, logprobs = [], []
        async for chunk in engine.run_job(job):
            text, lp = view.render(chunk)
            texts.append(text), logprobs.append(lp)
            last = chunk
        return "".join(texts), last, None

    async def all_jobs():
        return await asyncio.gather(*(one(j, v) for j, v in zip(prepared.jobs, prepared.views)))
    return front.response("cmpl-1", body, chat, prepared, asyncio.run(all_jobs()))


def test_a_completion_runs_through_the_front_as_plain_decoding_writes_it(front, engine, tokenizer):
    body = front.parse(raw(prompt=["def f(x):", "import os"], max_tokens=12, temperature=0), CompletionRequest)
    response = run(engine, front, body, chat=False)
    want = engine.generate(["def f(x):", "import os"], SamplingParams(max_tokens=12, temperature=0))
    assert [c["text"] for c in response["choices"]] == [r.text for r in want]
    assert response["model"] == "m" and response["object"] == "text_completion"
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in ["def f(x):", "import os"])
    assert response["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(r.token_ids) for r in want),
                                 "total_tokens": prompt_tokens + sum(len(r.token_ids) for r in want)}


def test_a_chat_is_templated_and_answered_as_a_chat_completion(front, engine):
    body = front.parse(raw(messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0),
                       ChatCompletionRequest)
    prepared = front.prepare(body, chat=True)
    assert prepared.prompts[0] == front.tokenizer("user: hi\nassistant: ")["input_ids"]  # the default template
    response = run(engine, front, body, chat=True)
    assert response["object"] == "chat.completion" and response["choices"][0]["message"]["role"] == "assistant"


def test_each_of_n_choices_draws_from_its_own_seed(front):
    body = front.parse(raw(prompt="a", n=3, seed=7, max_tokens=4), CompletionRequest)
    seeds = [job.params.seed for job in front.prepare(body, chat=False).jobs]
    assert len(set(seeds)) == 3 and seeds[0] == 7  # the first choice keeps the request's seed
    assert seeds == [job.params.seed for job in front.prepare(body, chat=False).jobs]  # and again


def test_the_caller_scope_and_cache_salt_keep_prompt_caches_apart(front):
    body = front.parse(raw(prompt="a", max_tokens=2, cache_salt="s"), CompletionRequest)
    assert front.prepare(body, False, scope="k").jobs[0].params.cache_salt == "k/s"
    assert front.prepare(body, False).jobs[0].params.cache_salt == "s"


@pytest.mark.parametrize("body, status, param", [
    (raw(model="other", prompt="a"), 404, "model"),
    (raw(prompt="a", max_tokens=41), 400, "max_tokens"),  # over the operator's cap
    (raw(prompt="a " * CONTEXT, max_tokens=1), 400, "prompt"),  # the prompt fills the context
    (raw(prompt="a", max_tokens=40, temperature=float("nan")), 400, None),  # NaN is not JSON
    (raw(prompt=[[1, 2], [3]], n=MAX_CHOICES // 2 + 1), 400, "n"),  # prompts x n over MAX_CHOICES
    (raw(prompt=[[1, 10**9]], max_tokens=2), 400, "prompt"),  # an id outside the vocabulary
    (raw(prompt="a", top_k="٣"), 400, "top_k"),  # a non-ASCII digit
    (b"[" * 5000 + b"]" * 5000, 413, None),  # over max_body_bytes
    (b'"a string"', 400, None),
])
def test_bad_requests_are_refused_in_openais_terms(front, body, status, param):
    def call():
        parsed = front.parse(body, CompletionRequest)
        front.prepare(parsed, chat=False)
    e = refusal(call)
    assert (e.status, e.param) == (status, param), e.message


def test_a_prompt_and_max_tokens_past_the_context_name_max_tokens(front):
    body = front.parse(raw(prompt=[[1] * (CONTEXT - 10)], max_tokens=20), CompletionRequest)
    e = refusal(lambda: front.prepare(body, chat=False))
    assert (e.status, e.param, e.code) == (400, "max_tokens", "context_length_exceeded")


def test_a_chat_offering_tools_needs_a_parser_and_a_request_template_needs_trust(front, tokenizer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body = front.parse(raw(**chat, tools=[tool]), ChatCompletionRequest)
    assert refusal(lambda: front.prepare(body, chat=True)).param == "tools"
    templated = front.parse(raw(**chat, chat_template="{{ messages[0]['content'] }}"), ChatCompletionRequest)
    assert refusal(lambda: front.prepare(templated, chat=True)).param == "chat_template"
    trusting = OpenAIFront(copy.deepcopy(tokenizer), FrontSettings("m", CONTEXT, trust_request_chat_template=True))
    assert trusting.prepare(templated, chat=True).prompts == [tokenizer("hi")["input_ids"]]


def test_a_resumed_stream_continues_each_choice_from_what_it_streamed(front):
    body = front.parse(raw(prompt="a", n=2, seed=3, max_tokens=8, stream=True), CompletionRequest)
    seeds = [job.params.seed for job in front.prepare(body, chat=False).jobs]
    state = json.dumps({"rid": "cmpl-9", "choices": [{"seed": seeds[0], "output_ids": [5, 6], "streamed_chars": 2},
                                                     {"seed": seeds[1], "done": True}]})
    prepared = front.prepare(body, chat=False, resume_header=state)
    assert prepared.resume.rid == "cmpl-9" and [c.done for c in prepared.starts] == [False, True]
    assert prepared.jobs[0].output_ids == [5, 6] and prepared.jobs[0].seed == seeds[0]
    not_streamed = front.parse(raw(prompt="a", n=2, max_tokens=8), CompletionRequest)
    assert refusal(lambda: front.prepare(not_streamed, chat=False, resume_header=state)).status == 400
