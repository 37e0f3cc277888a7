"""Request bodies as OpenAI clients send them: explicit nulls, harmless extras, fields we do not
honour (refused by name unless they change nothing), unknown fields, any int64 seed."""

import asyncio

import pytest
from pydantic import ValidationError

from app.engine import Engine
from app.errors import InvalidRequestError
from app.openai.protocol import ChatCompletionRequest, CompletionRequest, choice_seed, normalise_body
from app.openai.responses import ChoiceView, combined_speculation, join_logprobs
from app.params import SpeculationParams, parse_sampling
from app.model.runner import ModelRunner
from tests.conftest import blend


def completion(**body) -> CompletionRequest:
    data = normalise_body({"model": "target", "prompt": "x", **body}, CompletionRequest)
    return CompletionRequest.model_validate(data)


def refused(model_cls=CompletionRequest, **body) -> InvalidRequestError:
    first = {"prompt": "x"} if model_cls is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequestError) as e:
        normalise_body({"model": "target", **first, **body}, model_cls)
    return e.value


def test_explicit_null_means_the_default():
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "stream", "ignore_eos",
                           "speculation", "stream_options", "logprobs", "n", "user"])
    assert completion(**nulls) == completion()
    options = completion(stream_options={"include_usage": None, "continuous_usage_stats": True}).stream_options
    assert options.include_usage is False and options.continuous_usage_stats is True


def test_harmless_fields_are_accepted_and_no_op_values_too():
    body = completion(user="u-1", metadata={"team": "x"}, store=False, n=1, best_of=1, echo=False, logprobs=False,
                      presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0, logit_bias={},
                      min_tokens=0, stop_token_ids=[], response_format={"type": "text"}, tools=[], tool_choice="none")
    assert body.temperature == 1.0 and not body.model_extra


@pytest.mark.parametrize("field, value", [
    ("best_of", 3), ("top_logprobs", 5), ("suffix", "tail"),
])
def test_fields_we_do_not_honour_are_refused_by_name(field, value):
    err = refused(**{field: value})
    assert err.param == field and field in str(err)


def test_chat_echo_is_refused_by_name():
    assert refused(ChatCompletionRequest, echo=True).param == "echo"


def test_sampling_controls_and_logprobs_reach_the_sampling_params():
    spec = SpeculationParams()
    sp = completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1,
                    logit_bias={"5": 10, "7": -100}, min_tokens=4, logprobs=2, echo=True,
                    logprobs_mode="processed").sampling(16, spec)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p, sp.min_tokens) == \
        (0.5, -1.0, 1.2, 0.1, 4)
    assert sp.logit_bias == {5: 10.0, 7: -100.0} and sp.logprobs == 2 and sp.prompt_logprobs == 2
    assert sp.logprobs_mode == "processed" and sp.skip_special_tokens is True
    assert completion(skip_special_tokens=False).sampling(16, spec).skip_special_tokens is False
    assert completion(logprobs=0).sampling(16, spec).prompt_logprobs is None  # scored only when echoed
    assert completion(logprobs=False).sampling(16, spec).logprobs is None
    chat = {"model": "target", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 3}).sampling(
        16, spec).logprobs == 3
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).sampling(16, spec).logprobs == 0
    assert ChatCompletionRequest.model_validate(chat).sampling(16, spec).logprobs is None
    for bad in ({**chat, "top_logprobs": 2}, {"model": "target", "prompt": "x", "logprobs": True},
                {"model": "target", "prompt": "x", "logit_bias": {"five": 1}}):
        model_cls = ChatCompletionRequest if "messages" in bad else CompletionRequest
        with pytest.raises(ValidationError):
            model_cls.model_validate(bad)


def test_a_choice_renders_echo_and_logprobs_as_openai_does(tokenizer):
    prompt = [tokenizer.bos_token_id] + tokenizer("ab")["input_ids"]  # <s> a b
    out = tokenizer("cd", add_special_tokens=False)["input_ids"]
    entries = [(-0.5, [(out[0], -0.5), (3, -1.5)]), (-0.25, [(out[1], -0.25)])]
    view = ChoiceView(tokenizer, chat=False, logprobs=True, echo="ab", prompt_ids=prompt)
    text, lp = view.render({"text": "c", "token_ids": out[:1], "logprobs": entries[:1],
                            "prompt_logprobs": [(-2.0, [(5, -1.0)])] * (len(prompt) - 1)})
    assert text == "abc" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [tokenizer.decode([t]) for t in prompt + out[:1]]
    assert lp["token_logprobs"][1:] == [-2.0] * (len(prompt) - 1) + [-0.5]
    text2, lp2 = view.render({"text": "d", "token_ids": out[1:], "logprobs": entries[1:]})
    assert text2 == "d" and lp2["text_offset"] == [len(text)]  # offsets run on across chunks
    # offsets index the returned text: a special token (the prompt's <s>) takes no characters of it
    assert lp["text_offset"] == [0, 0, 1, 2] and lp["tokens"][0] == "<s>"
    assert join_logprobs([lp, lp2])["token_logprobs"][-2:] == [-0.5, -0.25]
    chat = ChoiceView(tokenizer, chat=True, logprobs=True)
    _, body = chat.render({"text": "cd", "token_ids": out, "logprobs": entries})
    assert [c["logprob"] for c in body["content"]] == [-0.5, -0.25]
    assert body["content"][0]["top_logprobs"][1] == {"token": tokenizer.decode([3]), "logprob": -1.5,
                                                     "bytes": list(tokenizer.decode([3]).encode())}
    assert ChoiceView(tokenizer, chat=False, logprobs=False, echo="ab").render({"text": "c"}) == ("abc", None)


def test_a_chat_takes_tools_a_completion_refuses_them_with_the_reason():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = ChatCompletionRequest.model_validate(normalise_body({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "tools": tools}, ChatCompletionRequest))
    assert body.calling() and body.tool_dicts()[0]["function"]["name"] == "f"
    err = refused(tools=tools)
    assert err.param == "tools" and "chat completions" in str(err)
    with pytest.raises(ValidationError) as e:  # no tools to call
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tool_choice": "required"})
    assert e.value.errors()[0]["loc"][0] == "tool_choice"


def test_unknown_fields_are_refused_by_name():
    err = refused(frobnicate=1)
    assert err.param == "frobnicate" and "unknown field" in str(err)
    # a typo of a real field is not silently ignored either
    assert refused(temprature=0).param == "temprature"


def test_a_guidellm_style_chat_body_is_accepted():
    body = {"model": "target", "stream": True, "max_completion_tokens": 8, "temperature": None,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = ChatCompletionRequest.model_validate(normalise_body(body, ChatCompletionRequest))
    assert chat.stream_options.continuous_usage_stats and chat.messages[0].for_template()["content"] == "hello"


def test_any_int64_seed_is_accepted_and_reproducible(target_model, tokenizer):
    assert completion(seed=-(2**63)).seed == -(2**63)
    for bad in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError):
            completion(seed=bad)
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))
    params = {"max_tokens": 12, "temperature": 1.0, "seed": -12345, "ignore_eos": True}
    first, again = (engine.generate("def f(x):", params)[0].token_ids for _ in range(2))
    assert first == again and len(first) == 12


def test_prompts_of_a_batch():
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=[5, 6]).prompts() == [[5, 6]]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[5], [6, 7]]).prompts() == [[5], [6, 7]]
    for bad in ([], [""], [[5], []], [["a"]]):
        with pytest.raises(ValueError):
            completion(prompt=bad)


def test_choice_seeds_are_the_seed_first_then_distinct_int64s():
    for seed in (0, 11, -(2**63), 2**63 - 1):
        seeds = [choice_seed(seed, j) for j in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64
        assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert choice_seed(11, 5) == choice_seed(11, 5) != choice_seed(12, 5)


def test_speculation_of_several_choices_weights_by_rounds():
    def stats(rounds, drafted, accepted, tau, ms):
        return {"drafted_tokens": drafted, "accepted_tokens": accepted, "rounds": rounds, "acceptance_rate": 0.0,
                "drafted_rounds": rounds - 1, "accepted_per_position": [rounds, accepted - rounds],
                "mean_accepted_length": tau, "fallback_rounds": 1, "max_target_batch_size": rounds,
                "draft_ahead_hit_rate": 0.5, "timing_ms": {"round": ms}}
    one = stats(10, 40, 30, 4.0, 20.0)
    assert combined_speculation([one]) is one
    both = combined_speculation([one, stats(30, 60, 15, 1.5, 10.0)])
    counts = (both["rounds"], both["drafted_tokens"], both["accepted_tokens"], both["fallback_rounds"])
    assert counts == (40, 100, 45, 2)
    assert both["acceptance_rate"] == 0.45 and both["mean_accepted_length"] == (40 + 45) / 40
    assert both["timing_ms"]["round"] == 12.5 and both["max_target_batch_size"] == 30
    assert both["drafted_rounds"] == 38 and both["accepted_per_position"] == [40, 5]


def _finish(counters, speculation: dict) -> None:
    """One generation through `counters` from arrival to its end, with `speculation` as its summary."""
    counters.arrived()
    counters.first_token(0.05)
    counters.finished(started=True, reason="length", prompt_tokens=3, generated=2, e2e_s=0.1, ttft_s=0.05,
                      prompt_forward_s=None, speculation=speculation)


def test_vllm_spec_decode_counters_read_as_vllms_client_reads_them():
    """`vllm bench serve` sums lines starting `vllm:spec_decode` whose name ends in `_total`."""
    from deployments.vllm_metrics import VLLMMetrics

    counters = VLLMMetrics("target")
    _finish(counters, {"drafted_rounds": 3, "drafted_tokens": 12, "accepted_tokens": 7, "accepted_per_position": [3, 3, 1]})
    _finish(counters, {"drafted_rounds": 1, "drafted_tokens": 4, "accepted_tokens": 4, "accepted_per_position": [1] * 4})
    totals, per_pos = {}, {}
    for line in asyncio.run(counters.render()).decode().splitlines():
        if line.startswith("vllm:spec_decode") and line.split(None, 1)[0].split("{")[0].endswith("_total"):
            name, value = line.split("{")[0], float(line.rsplit(None, 1)[-1])
            if "per_pos" in name:
                per_pos[int(line.split('position="')[1].split('"')[0])] = value
            else:
                totals[name] = value
    assert totals == {"vllm:spec_decode_num_drafts_total": 4, "vllm:spec_decode_num_draft_tokens_total": 16,
                      "vllm:spec_decode_num_accepted_tokens_total": 11}
    assert per_pos == {0: 4, 1: 4, 2: 2, 3: 1}


def test_every_ingress_replica_serves_the_same_spec_decode_totals():
    """Two replicas' counters over one totals store (in the app, a Ray actor): a scrape of either shows
    the sum of both, whichever one answers; with the store gone a replica shows its own counts."""
    from deployments.vllm_metrics import MetricTotals, VLLMMetrics

    store = MetricTotals()

    async def add(delta, gauges=None, source=None):
        return store.add(delta, gauges, source)

    def scrape(counters) -> str:
        return asyncio.run(counters.render()).decode()

    a, b = (VLLMMetrics("target", totals=add, flush_s=3600) for _ in range(2))
    _finish(a, {"drafted_rounds": 3, "drafted_tokens": 12, "accepted_tokens": 7, "accepted_per_position": [3, 3, 1]})
    _finish(b, {"drafted_rounds": 1, "drafted_tokens": 4, "accepted_tokens": 4, "accepted_per_position": [1] * 4})
    asyncio.run(b.flush())
    first = scrape(a)
    assert 'vllm:spec_decode_num_drafts_total{model_name="target"} 4.0' in first
    assert scrape(b) == scrape(a) == first  # the same totals, whichever replica answers

    async def gone(delta, gauges=None, source=None):
        raise ConnectionError("the totals actor is gone")
    c = VLLMMetrics("target", totals=gone, flush_s=3600)
    _finish(c, {"drafted_rounds": 2, "drafted_tokens": 2, "accepted_tokens": 1, "accepted_per_position": [1]})
    assert 'vllm:spec_decode_num_drafts_total{model_name="target"} 2.0' in scrape(c)
    assert c.pending["drafts"] == 2  # kept for when the store is back


def test_stop_token_ids_end_generation_under_speculation(target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))
    greedy = {"max_tokens": 16, "temperature": 0.0, "speculation": {"num_tokens": 3}}
    free = engine.generate("def f(x):", greedy)[0].token_ids
    j = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token first emitted at position j
    for ignore_eos in (False, True):  # ignore_eos is about the model's eos ids only
        out = engine.generate("def f(x):", {**greedy, "stop_token_ids": [free[j]], "ignore_eos": ignore_eos})[0]
        assert out.token_ids == free[:j] and out.finish_reason == "stop"
    assert completion(stop_token_ids=[free[j]]).sampling(4, SpeculationParams()).stop_token_ids == [free[j]]
    with pytest.raises(InvalidRequestError) as e:
        parse_sampling({"stop_token_ids": [-1]})
    assert e.value.param == "stop_token_ids"


def test_a_bad_value_in_a_union_field_names_the_field_not_the_members_tried():
    from pydantic import ValidationError

    from app.errors import invalid

    chat = {"model": "target", "messages": [{"role": "user", "content": "hi"}]}
    for body, model_cls, param in [({**chat, "tools": [], "tool_choice": "sometimes"}, ChatCompletionRequest,
                                    "tool_choice"),
                                   ({**chat, "messages": [{"role": "user", "content": 5}]}, ChatCompletionRequest,
                                    "messages.content"),
                                   ({"model": "target", "prompt": {"a": 1}}, CompletionRequest, "prompt"),
                                   ({"model": "target", "prompt": "x", "logit_bias": {"5": "x"}}, CompletionRequest,
                                    "logit_bias.5")]:
        with pytest.raises(ValidationError) as e:
            model_cls.model_validate(body)
        assert invalid(e.value.errors()).param == param
