"""Exactness on the reference pair (SmolLM2-135M-Instruct and its shipped draft), where it is cached.

The suite never downloads it: these tests skip, with one line saying how to build it, on a machine
that has not run `specserve demo-models --pair smollm2` (or `make serve`) with the same cache.
"""

import concurrent.futures
from pathlib import Path

import httpx
import pytest
import torch
from scipy import stats

from specserve.demo import smollm2

ROOT = smollm2.pair_root()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (ROOT / "target" / smollm2.PROVENANCE).exists() or not (ROOT / "draft" / smollm2.PROVENANCE).exists(),
    reason=f"the reference pair is not cached in {ROOT}: build it with `.venv/bin/specserve demo-models --pair smollm2`")]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    return str(ROOT / "target"), str(ROOT / "draft")


def _ids(tok, prompt: dict) -> list[int]:
    from specserve.demo.measure import prompt_ids

    return prompt_ids(tok, prompt)[0].tolist()


def test_the_target_in_bf16_keeps_its_compiled_steps(pair):
    """The warm-up's check probes ordinary text: on ids 3-10 (special tokens) this model's bf16
    activations blow up (eager and compiled 47 apart where on text they agree within 0.7), and its
    bf16 steps never compiled on a CPU."""
    from app.model import dtypes
    from app.model.loading import load_model
    from app.model.runner import Execution, ModelRunner

    if not dtypes.native_bf16("cpu"):  # torch's scalar fallback: 248 s on an AVX2-only EPYC, for a check of compiling
        pytest.skip("this CPU has no native bf16 matmul, so a bf16 model serves in float32 here (dtype auto)")
    model, tok = load_model(pair[0], dtype="bfloat16", device="cpu")
    runner = ModelRunner(model, tok, Execution(pack=True, compile="default", compile_max_tokens=8))
    runner.on_thread(runner.warm)
    assert runner.steps is not None
    assert tok.decode(runner._probe_ids(8)).startswith("The quick brown")


def test_greedy_speculative_equals_plain_equals_hf_generate(pair):
    """Every third held-out prompt (11 chat, 5 code; all 48 took 255 s of the suite, HF's own decoding
    most of it): plain, K = 4 and adaptive K each give HF generate's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.engine import Engine
    from app.params import SamplingParams

    target, draft = pair
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = [_ids(tok, p) for p in smollm2.load_heldout()[::3]]
    assert len(prompts) == 16
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, top_p=None,
                                 top_k=None, temperature=None, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            new = out[0, len(ids):].tolist()
            # HF keeps the eos it stopped on; a served answer ends before it (finish_reason "stop")
            want.append((new[:-1], "stop") if new[-1] == tok.eos_token_id else (new, "length"))
    del model
    engine = Engine.from_pretrained(target, draft, dtype="float32")
    for k in ("off", 4, "auto"):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                speculation={"enabled": False} if k == "off" else {"num_tokens": k})
        results = engine.generate(prompts, params)
        got = [(r.token_ids, r.finish_reason) for r in results]
        mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not mismatched, f"K={k}: prompts {mismatched} differ from HF generate"
        if k == 4:
            assert sum(r.speculation["drafted_tokens"] for r in results) > 0  # the draft really ran


def test_sampled_output_has_the_targets_distribution_through_http(pair):
    """The first two tokens of a sampled chat answer, drawn 400 times with speculation at K = 4 through
    the served app, against the target's own joint probabilities of those tokens (chi-square)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving import running_app

    target, draft = pair
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = _ids(tok, {"kind": "chat", "prompt": messages[0]["content"]})
    with torch.no_grad():  # p(a) p(b | a) for the likeliest pairs; the rest lumped together
        p1 = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        firsts = p1.topk(6).indices.tolist()
        pairs = {}  # keyed by the tokens' texts, as the response's logprobs name them
        for a in firsts:
            p2 = torch.softmax(model(torch.tensor([ids + [a]])).logits[0, -1].float(), -1)
            for b in p2.topk(6).indices.tolist():
                key = (tok.decode([a]), tok.decode([b]))
                pairs[key] = pairs.get(key, 0.0) + float(p1[a] * p2[b])
    n = 400
    with running_app(target, draft, compiled=False) as url:  # the compiled steps: the bf16 test above
        def one(seed: int) -> tuple[tuple[str, str], int]:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "target", "messages": messages, "max_tokens": 3, "temperature": 1.0, "seed": seed,
                "logprobs": True, "speculation": {"num_tokens": 4}})
            r.raise_for_status()
            body = r.json()
            content = body["choices"][0]["logprobs"]["content"]
            return (content[0]["token"], content[1]["token"]), body["speculation"]["drafted_tokens"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(n)))
    assert sum(d for _, d in results) > 0  # the sampled tokens went through rejection sampling
    keys = [k for k, p in pairs.items() if p * n >= 5]  # chi-square wants expected counts of 5 or more
    counts = [sum(r == k for r, _ in results) for k in keys]
    expected = [pairs[k] * n for k in keys]
    counts.append(n - sum(counts))
    expected.append(n - sum(expected))
    assert stats.chisquare(counts, expected).pvalue > 1e-3, list(zip(keys, counts, expected))
