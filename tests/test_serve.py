"""End to end over HTTP on a local two-node cluster, with the official openai client."""

import asyncio
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from app.engine import Engine
from app.params import SamplingParams
from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow
PROMPTS = [f"def f{i}(x):\n    return x" + " + 1" * (i % 5) for i in range(16)]
N = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def app(pair):
    with running_app(*pair) as url:
        yield url


@pytest.fixture(scope="module")
def local(pair):
    """The target in process, alone: what the served app must reproduce."""
    return Engine.from_pretrained(pair[0])


@pytest.fixture(scope="module")
def reference(local):
    """In-process target-only greedy output for every prompt."""
    engine = local
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, speculation={"enabled": False})
    return {p: r.text for p, r in zip(PROMPTS, engine.generate(PROMPTS, params))}


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=120)


EXTRA = {"ignore_eos": True}


def test_models_and_health(app, client):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert httpx.get(f"{app}/health").json() == {"status": "ok"}


def test_every_replica_runs_at_the_nodes_default_priority(app):
    """Ray starts workers at niceness 15 unless told otherwise (cluster/local.py SERVE_ENV); a replica
    there yields its core to any process at the default priority."""
    import os

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")]
    kinds = {a["name"].split("#")[1] for a in replicas}
    assert {"TargetServer", "DraftServer"} <= kinds, kinds
    for a in replicas:
        actor = ray.get_actor(a["name"], namespace=a["namespace"])
        niceness = ray.get(actor.__ray_call__.remote(lambda _: os.getpriority(os.PRIO_PROCESS, os.getpid())))
        assert niceness == 0, (a["name"], niceness)


def test_completion_is_the_targets_greedy_output(client, reference):
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=N, temperature=0, extra_body=EXTRA)
    assert r.choices[0].text == reference[PROMPTS[0]]
    assert r.usage.completion_tokens == N
    spec = r.model_extra["speculation"]
    assert set(spec) >= {"drafted_tokens", "accepted_tokens", "rounds", "acceptance_rate", "mean_accepted_length",
                         "fallback_rounds"}
    assert spec["rounds"] >= 1


def test_streamed_text_equals_non_streamed(client, reference):
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=EXTRA))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[PROMPTS[1]]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == N
    assert last.model_extra["speculation"]["rounds"] >= 1


def test_chat_completion_streamed_and_not(client):
    messages = [{"role": "user", "content": "write a function"}]
    kw = dict(model="target", messages=messages, max_tokens=12, temperature=0, extra_body=EXTRA)
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert full == streamed and len(full) > 0


def test_a_guidellm_style_stream_gets_usage_on_every_chunk(client):
    """What benchmark clients send: content parts, explicit nulls, harmless extras, continuous usage."""
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": [{"type": "text", "text": "write a function"}]}],
        max_completion_tokens=12, temperature=0, stream=True, user="bench-1", top_p=None, seed=None,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body=EXTRA))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 1
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"


def test_fields_we_do_not_honour_get_a_400_naming_them(app):
    for field, value in (("best_of", 2), ("response_format", {"type": "xml"}),
                         ("response_format", {"type": "json_object"}),  # this tiny tokenizer: no grammars
                         ("frobnicate", 1),
                         ("stop_token_ids", [-1]), ("logit_bias", {"100000": 1}), ("min_tokens", 9)):
        r = httpx.post(f"{app}/v1/completions", json={"model": "target", "prompt": "x", field: value, "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{app}/v1/completions", timeout=30, json={"model": "target", "prompt": "x", "max_tokens": 2,
                                                              "presence_penalty": 0, "logprobs": None, "seed": -5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_loglikelihood_as_lm_eval_asks_for_it(client, local):
    """lm-eval's loglikelihood request: echo, logprobs 1, one token; the prompt's tokens scored by the target."""
    prompt = PROMPTS[2]
    r = client.completions.create(model="target", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    want = local.generate(prompt, dict(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(want.prompt_token_ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e[0] for e in want.prompt_logprobs + want.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) == 1 for t in lp.top_logprobs[1:])


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, local):
    """Prompt scoring (vLLM's): the prompt's logprobs and no output token."""
    prompt = PROMPTS[3]
    r = client.completions.create(model="target", prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice, want = r.choices[0], local.generate(prompt, dict(max_tokens=0, prompt_logprobs=1))[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert want.token_ids == [] and len(choice.logprobs.tokens) == len(want.prompt_token_ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e[0] for e in want.prompt_logprobs], abs=1e-4)
    with pytest.raises(openai.BadRequestError):  # without echo there would be nothing to answer
        client.completions.create(model="target", prompt=prompt, max_tokens=0)


def test_chat_logprobs_stream_a_token_at_a_time_with_alternatives(client, local):
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "write"}], max_completion_tokens=10, temperature=0,
        logprobs=True, top_logprobs=3, stream=True, extra_body=EXTRA))
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == 10
    assert all(len(t.top_logprobs) == 3 and t.logprob == t.top_logprobs[0].logprob <= 0 for t in content)
    # each token's text in order (an end-of-sequence token, kept under ignore_eos, shows in the tokens only)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(t.token for t in content).replace("</s>", "") == text


def test_penalties_and_bias_over_http_are_the_engines(client, local):
    controls = dict(presence_penalty=0.6, frequency_penalty=0.8, logit_bias={"9": 5.0})
    extra = dict(EXTRA, repetition_penalty=1.3, min_tokens=3, speculation={"num_tokens": 3})
    r = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=N, temperature=0, **controls,
                                  extra_body=extra)
    want = local.generate(PROMPTS[1], dict(temperature=0, max_tokens=N, ignore_eos=True, presence_penalty=0.6,
                                           frequency_penalty=0.8, logit_bias={9: 5.0}, repetition_penalty=1.3,
                                           min_tokens=3))[0]
    plain = local.generate(PROMPTS[1], dict(temperature=0, max_tokens=N, ignore_eos=True))[0]
    assert r.choices[0].text == want.text != plain.text


def test_a_batch_of_prompts_gets_one_choice_each_in_order(client, reference):
    batch = PROMPTS[3:6]
    r = client.completions.create(model="target", prompt=batch, max_tokens=N, temperature=0, extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [reference[p] for p in batch]
    assert r.usage.completion_tokens == 3 * N and r.model_extra["speculation"]["rounds"] >= 3
    ids = [client.completions.create(model="target", prompt=p, max_tokens=1, temperature=0).usage.prompt_tokens
           for p in batch]
    assert r.usage.prompt_tokens == sum(ids)
    # token-id prompts, streamed: each chunk names its choice
    tokens = [[5, 6, 7], [8, 9]]
    chunks = list(client.completions.create(model="target", prompt=tokens, max_tokens=N, temperature=0, stream=True,
                                            extra_body=EXTRA))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    alone = [client.completions.create(model="target", prompt=t, max_tokens=N, temperature=0,
                                       extra_body=EXTRA).choices[0].text for t in tokens]
    assert [streamed[0], streamed[1]] == alone


def test_n_choices_have_their_own_reproducible_seeds(client):
    kw = dict(model="target", prompt=PROMPTS[0], max_tokens=N, temperature=1.0, seed=11, extra_body=EXTRA)
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 3 * N
    assert texts == [c.text for c in client.completions.create(n=3, **kw).choices]  # reproducible
    assert texts[0] == client.completions.create(**kw).choices[0].text  # the first choice is the seed's own
    assert len(set(texts)) > 1  # the others draw their own numbers (24 sampled tokens: equal by chance ~never)
    streamed = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    by_index = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [by_index[i] for i in range(3)] == texts and streamed[-1].usage.completion_tokens == 3 * N


def test_vllms_spec_decode_counters_on_metrics(app, client):
    def totals() -> dict:
        lines = httpx.get(f"{app}/metrics", timeout=30).text.splitlines()
        return {ln.split("{")[0]: float(ln.rsplit(None, 1)[-1]) for ln in lines
                if ln.startswith("vllm:spec_decode_num_") and "per_pos" not in ln}
    before = totals()
    r = client.completions.create(model="target", prompt=PROMPTS[7], max_tokens=N, temperature=0,
                                  extra_body={**EXTRA, "speculation": {"num_tokens": 3}})
    after, spec = totals(), r.model_extra["speculation"]
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["vllm:spec_decode_num_draft_tokens_total"] == spec["drafted_tokens"] > 0
    assert grew["vllm:spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"]
    assert grew["vllm:spec_decode_num_drafts_total"] == spec["drafted_rounds"] > 0


def test_pinned_k_and_speculation_off(client, reference):
    for spec in ({"num_tokens": 3}, {"enabled": False}):
        r = client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=N, temperature=0,
                                      extra_body={**EXTRA, "speculation": spec})
        assert r.choices[0].text == reference[PROMPTS[2]]
        drafted = r.model_extra["speculation"]["drafted_tokens"]
        assert (drafted > 0) if spec.get("num_tokens") else drafted == 0


def test_concurrent_requests_match_sequential_and_batch(app, reference):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(
                c.completions.create(model="target", prompt=p, max_tokens=N, temperature=0,
                                     extra_body={**EXTRA, "speculation": {"num_tokens": 2}}) for p in PROMPTS))
    results = asyncio.run(run())
    assert [r.choices[0].text for r in results] == [reference[p] for p in PROMPTS]
    # under 16 concurrent streams, verify calls really fused into batches
    assert max(r.model_extra["speculation"]["max_target_batch_size"] for r in results) > 1


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "n": 65}, 400, "n"),
    ({"prompt": ["x"] * 33, "n": 2}, 400, "n"),
    ({"prompt": ["x", ""]}, 400, "prompt"),
    ({"prompt": "x", "speculation": {"num_tokens": -2}}, 400, "speculation.num_tokens"),
    ({"prompt": "x", "speculation": {"num_tokens": 99}}, 400, "speculation.num_tokens"),
    ({"prompt": "x", "speculation": {"bogus": 1}}, 400, "speculation.bogus"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "x" * 600, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(app, body, status, param):
    r = httpx.post(f"{app}/v1/completions", json={"model": "target", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_malformed_bodies(app, client):
    for content in (b"{not json", b"\xff\xfe\x00", b"[1, 2]"):
        r = httpx.post(f"{app}/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{app}/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413
    # the server keeps serving after bad input
    assert client.completions.create(model="target", prompt="ok", max_tokens=2, temperature=0).choices


def test_replicas_run_on_their_pools(app):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for name, pool in (("DraftServer", "draft_pool"), ("TargetServer", "target_pool")):
        stats = serve.get_deployment_handle(name, "specserve").stats.remote().result(timeout_s=60)
        assert pool in nodes[stats["node_id"]], f"{name} landed on a node without {pool}"
        other = "target_pool" if pool == "draft_pool" else "draft_pool"
        assert other not in nodes[stats["node_id"]]


def test_the_replicas_take_their_compiled_steps_and_keep_the_targets_tokens(app, client, reference):
    """Each replica serves on eager forwards from its start and takes its compiled steps once built in
    the background (compile_in_background); its answers stay the target's."""
    from cluster.local import steps_status

    for _ in range(600):  # bounded: the two tiny models build in seconds
        status = steps_status("specserve")
        if len(status) == 2 and not any(s.startswith("compiling") for s in status.values()):
            break
        time.sleep(1)
    assert status == {"TargetServer": "compiled", "DraftServer": "compiled"}
    r = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=N, temperature=0, extra_body=EXTRA)
    assert r.choices[0].text == reference[PROMPTS[1]]
    # the ingress's /metrics counts the replicas by their steps' state (each reports within its gauges' interval)
    for _ in range(60):  # bounded
        lines = [ln for ln in httpx.get(f"{app}/metrics", timeout=30).text.splitlines()
                 if ln.startswith("specserve:replica_steps{")]
        if sum(float(ln.split()[-1]) for ln in lines if 'state="compiled"' in ln) == 2:
            break
        time.sleep(1)
    compiled = {ln.split('server="')[1].split('"')[0]: float(ln.split()[-1]) for ln in lines if 'state="compiled"' in ln}
    assert compiled == {"target": 1.0, "draft": 1.0}, lines


INVALID = [  # (params of a job that no model of the pair can run, the parameter its error names)
    ({"speculation": {"num_tokens": 9}}, "speculation.num_tokens"),  # past k_max (8)
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),  # a token the vocabulary lacks
    ({"top_k": 100000}, "top_k"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
]


@pytest.mark.parametrize("fields, param", INVALID, ids=[p for _, p in INVALID])
def test_an_invalid_job_gets_the_same_error_through_every_entry_point(app, local, fields, param):
    """Validation happens in one place (app/job.py, admit): the job is refused alike over HTTP, over a
    Serve handle to the target pool, and by the in-process engine."""
    from app.errors import InvalidRequestError
    from app.job import GenerationJob

    ids, params = [5, 6, 7], SamplingParams(max_tokens=4, **fields)
    r = httpx.post(f"{app}/v1/completions", json={"model": "target", "prompt": ids, "max_tokens": 4, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    over_http = (r.json()["error"]["param"], r.json()["error"]["message"])

    handle = serve.get_deployment_handle("TargetServer", "specserve").options(stream=True)
    with pytest.raises(InvalidRequestError) as e:
        next(iter(handle.generate.remote(GenerationJob.new(ids, params))))
    cause = getattr(e.value, "cause", e.value)
    over_handle = (cause.param, str(cause))

    with pytest.raises(InvalidRequestError) as e:
        local.new_request(ids, params)
    in_process = (e.value.param, str(e.value))
    assert over_http == over_handle == in_process and over_http[0] == param


def test_tokenize_and_detokenize_over_http(app, local, client):
    r = httpx.post(f"{app}/tokenize", json={"model": "target", "prompt": "def f(x):"}, timeout=30).json()
    assert r["tokens"] == local.tokenizer("def f(x):")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > r["count"]
    assert httpx.post(f"{app}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json() == {"prompt": "def f(x):"}
    # a chat's ids are those the chat endpoint generates from
    messages = [{"role": "user", "content": "sort a list"}]
    chat = httpx.post(f"{app}/tokenize", json={"messages": messages}, timeout=30).json()
    used = client.chat.completions.create(model="target", messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == used.usage.prompt_tokens
    bad = httpx.post(f"{app}/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{app}/tokenize", json={"model": "nope", "prompt": "x"}, timeout=30).status_code == 404
