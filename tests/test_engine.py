"""The in-process engine: greedy identity with plain decoding, seeded determinism, stops, bad input."""

import asyncio

import pytest
import torch

from app.speculation.draft_policy import DraftPolicy
from app.engine import Engine, EngineSettings
from app.errors import ContextLengthError, InvalidRequestError, VocabularyMismatchError
from app.params import SamplingParams
from app.model.runner import ModelRunner
from conftest import blend, make_model, make_tokenizer

PROMPTS = ["def fib(n):", "hello world, this is a longer prompt than the others", "x", "for i in range(10):\n  "]


def reference(model, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding of the target alone, n tokens, EOS ignored."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def greedy(n: int = 24, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, speculation=spec or {})


@pytest.fixture(scope="module")
def drafts(target_model):
    return {"same": target_model, "random": make_model(seed=99), "partial": blend(target_model, 7, 0.85)}


@pytest.mark.parametrize("kind", ["same", "random", "partial"])
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_is_token_identical_to_plain_decoding(kind, k, drafts, target_model, tokenizer):
    # proposals of K, as asked (a proposal that ends where the draft is unsure: tests/test_draft_length.py)
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts[kind], tokenizer),
                    EngineSettings(policy=DraftPolicy(stop_below=0.0)))
    batch = engine.generate(PROMPTS, greedy(num_tokens=k))
    alone = engine.generate(PROMPTS[1], greedy(num_tokens=k))[0]
    for r in batch + [alone]:
        assert r.token_ids == reference(target_model, r.prompt_token_ids, 24)
    assert alone.token_ids == batch[1].token_ids
    if kind == "same" and k == 4:
        # alone on its target a round always waits for its proposal; in a batch a proposal not yet in
        # hand is skipped for a plain step, which the machine's speed decides, so only `alone` is checked
        assert alone.speculation["acceptance_rate"] == 1.0
        assert alone.speculation["mean_accepted_length"] > 4.0


def test_k0_is_plain_target_decoding(target_model, tokenizer, drafts):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["partial"], tokenizer))
    r = engine.generate(PROMPTS[0], greedy(enabled=False))[0]
    assert r.token_ids == reference(target_model, r.prompt_token_ids, 24)
    assert r.speculation["drafted_tokens"] == 0 and r.speculation["rounds"] == 24
    assert r.speculation["fallback_rounds"] == 0


def test_rounds_are_batched(target_model, tokenizer, drafts):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["partial"], tokenizer))
    engine.generate(PROMPTS, greedy(num_tokens=3))
    assert max(engine.verifier.batch_sizes) == len(PROMPTS)
    # a sequence may have its proposal and the next round's, drafted ahead, in one draft batch
    assert len(PROMPTS) <= max(engine.drafter.batch_sizes) <= 2 * len(PROMPTS)


def test_seeded_sampling_does_not_depend_on_the_batch(target_model, tokenizer, drafts):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["partial"], tokenizer))
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    alone = engine.generate(PROMPTS[0], params)[0]
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = engine.generate(PROMPTS, [params, others, others, others])
    again = engine.generate(PROMPTS[0], params)[0]
    assert alone.token_ids == batch[0].token_ids == again.token_ids
    other_seed = engine.generate(PROMPTS[0], params.model_copy(update={"seed": 4321}))[0]
    assert other_seed.token_ids != alone.token_ids


def test_seeded_sampling_is_the_same_with_and_without_speculation_k(target_model, tokenizer, drafts):
    """Different K changes which draws are made, not the distribution; same K and seed → same output."""
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["partial"], tokenizer))
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7, ignore_eos=True, speculation={"num_tokens": 3})
    assert engine.generate(PROMPTS[2], params)[0].token_ids == engine.generate(PROMPTS[2], params)[0].token_ids


def test_same_prompt_choices_share_one_prefill(target_model, tokenizer, drafts):
    """A request's n choices (n sequences, one context) on one engine: the first prefills it, the others
    wait for that and borrow its KV, computing only their last position; each output is what it is alone."""
    prompt = PROMPTS[1]
    seeded = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True) for s in range(4)]

    def engine():
        return Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["partial"], tokenizer))

    for params in ([greedy(16)] * 4, seeded):
        shared = engine()
        together = shared.generate([prompt] * 4, params)
        n = len(together[0].prompt_token_ids)
        assert shared.target.cache.prefix_hit_tokens == 3 * (n - 1)
        assert [r.token_ids for r in together] == [engine().generate(prompt, p)[0].token_ids for p in params]
        assert not shared.prefills._now


@pytest.mark.parametrize("how", ["fails", "is cancelled"])
def test_a_leader_that_ends_before_its_prefill_releases_its_waiters(how, target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer))
    submit, log = engine.verifier.submit, []

    async def verify(item):
        log.append(item.seq_id)
        if item.seq_id == "lead":
            await asyncio.sleep(0.05)
            log.append("lead ended")
            if how == "fails":
                raise RuntimeError("the target lost this sequence")
            asyncio.current_task().cancel()
            await asyncio.sleep(1)
        return await submit(item)

    engine.verifier.submit = verify
    states = [engine.new_request(PROMPTS[1], greedy(8), request_id=r) for r in ("lead", "f1", "f2")]

    async def run(state):
        async for _ in engine.stream(state):
            pass

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(run(s) for s in states), return_exceptions=True), 60)

    lead, *followers = asyncio.run(main())
    assert isinstance(lead, RuntimeError if how == "fails" else asyncio.CancelledError)
    assert followers == [None, None]
    assert log.index("lead ended") < min(log.index("f1"), log.index("f2"))  # they waited for it, then went on
    for s in states[1:]:
        assert s.output_ids == reference(target_model, s.prompt_ids, 8)
    assert not engine.prefills._now


def test_draft_with_padded_vocabulary_works(target_model, tokenizer):
    padded = make_model(seed=5, vocab_rows=len(tokenizer) + 30)
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(padded, tokenizer))
    r = engine.generate(PROMPTS[0], greedy(num_tokens=3))[0]
    assert r.token_ids == reference(target_model, r.prompt_token_ids, 24)


def test_max_tokens_and_eos(target_model, tokenizer, drafts):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["same"], tokenizer))
    r = engine.generate(PROMPTS[0], greedy(n=7, num_tokens=4))[0]
    assert len(r.token_ids) == 7 and r.finish_reason == "length"
    ref = reference(target_model, r.prompt_token_ids, 24)
    # make the 5th greedy token the end-of-sequence token: generation must stop right there
    eos_tok = make_tokenizer()
    eos_tok.eos_token = tokenizer.convert_ids_to_tokens(ref[4])
    engine = Engine(ModelRunner(target_model, eos_tok), ModelRunner(drafts["same"], eos_tok))
    r = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, speculation={"num_tokens": 4}))[0]
    assert r.finish_reason == "stop" and r.token_ids == ref[: ref.index(ref[4])]


def test_stop_string_across_token_boundaries(target_model, tokenizer, drafts):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(drafts["same"], tokenizer))
    full = engine.generate(PROMPTS[0], greedy(n=24, num_tokens=4))[0]
    stop = full.text[9:12]  # three characters = three tokens of the char tokenizer, inside an accepted run
    cut = full.text.index(stop)
    r = engine.generate(PROMPTS[0], greedy(n=24, num_tokens=4).model_copy(update={"stop": [stop, "never"]}))[0]
    assert r.finish_reason == "stop"
    assert r.text == full.text[:cut]
    assert r.token_ids == full.token_ids[: cut + len(stop)]


def test_context_limit_stops_generation(tokenizer):
    model = make_model(seed=1, max_positions=40)
    engine = Engine(ModelRunner(model, tokenizer), ModelRunner(model, tokenizer))
    r = engine.generate("a" * 30, greedy(n=50, num_tokens=6))[0]
    assert r.finish_reason == "length" and len(r.prompt_token_ids) + len(r.token_ids) == 40
    with pytest.raises(ContextLengthError):
        engine.generate("a" * 45, greedy())


@pytest.mark.parametrize("params, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"speculation": {"num_tokens": -1}}, "speculation.num_tokens"),
    ({"speculation": {"num_tokens": 99}}, "speculation.num_tokens"),
    ({"stop": [""]}, "stop"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_parameters_raise_a_typed_error(params, param, target_runner):
    engine = Engine(target_runner)
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("hi", params)
    assert err.value.param == param


def test_empty_prompt_is_rejected(target_runner):
    with pytest.raises(InvalidRequestError, match="empty"):
        Engine(target_runner).generate("", {"max_tokens": 4})


def test_vocabulary_mismatch_names_the_tokens(target_model, tokenizer):
    other = make_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(VocabularyMismatchError, match="id 98"):
        Engine(ModelRunner(target_model, tokenizer), ModelRunner(target_model, other))


def test_from_pretrained_local_directories(model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = Engine.from_pretrained(model_dirs["target"], model_dirs["draft"], k_max=4)
    r = engine.generate(PROMPTS[0], greedy(num_tokens=4))[0]
    assert r.token_ids == reference(engine.target.model, r.prompt_token_ids, 24)
    assert r.speculation["drafted_tokens"] > 0


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(target_runner, tokenizer):
    engine = Engine(target_runner, ModelRunner(blend(target_runner.model, 7, 0.85), tokenizer))
    scored = engine.generate(PROMPTS[0], dict(max_tokens=0, prompt_logprobs=2))[0]
    one = engine.generate(PROMPTS[0], dict(max_tokens=1, prompt_logprobs=2, temperature=0))[0]
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.text == ""
    assert [e[0] for e in scored.prompt_logprobs] == pytest.approx([e[0] for e in one.prompt_logprobs], abs=1e-5)
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids) - 1


def test_every_forward_of_a_runner_and_its_warm_up_run_on_the_runners_one_thread(model_dirs, monkeypatch):
    """CUDA graphs are recorded per thread: a warm-up in the loading thread and forwards spread over
    asyncio's default pool would re-record every bucket in each thread. Each runner has one."""
    import threading

    import app.model.loading
    from app.engine import Engine

    warmed = []
    real_warm_up = app.model.loading.warm_up
    monkeypatch.setattr(app.model.loading, "warm_up", lambda r: warmed.append((r, threading.get_ident())) or real_warm_up(r))
    engine = Engine.from_pretrained(model_dirs["target"], model_dirs["draft"], max_cache_bytes=1 << 24)
    seen = {}
    for r in (engine.target, engine.draft):
        real = r.model.forward

        def record(*args, _r=r, _real=real, **kwargs):
            seen.setdefault(id(_r), set()).add(threading.get_ident())
            return _real(*args, **kwargs)
        r.model.forward = record
    out = engine.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]],
                          {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "speculation": {"num_tokens": 3}})
    assert all(len(o.token_ids) == 6 for o in out) and sum(o.speculation["drafted_tokens"] for o in out) > 0
    for r in (engine.target, engine.draft):
        assert seen[id(r)] == {r._ident}  # every forward on one thread, the runner's own
        assert (r, r._ident) in warmed  # and its warm-up there too
    assert engine.target._ident != engine.draft._ident != threading.get_ident()


def test_a_runner_no_longer_used_is_freed_though_its_forward_thread_ran(target_model, tokenizer):
    """The forward thread must not hold its runner: the suite's thousands of runners (each with a KV
    pool made at its first forward) were all kept alive until memory ran out."""
    import gc
    import weakref

    from app.model.runner import ModelRunner, SeqInput

    runner = ModelRunner(target_model, tokenizer)
    runner.on_thread(runner.forward, [SeqInput("a", [5, 6, 7], 1)])
    assert runner.cache.pool is not None and runner._ident is not None
    freed = weakref.ref(runner)
    del runner
    gc.collect()
    assert freed() is None
