"""History-dependent logit rules (penalties, logit bias, min_tokens) and min_p, exact under speculation.

- the rules against transformers' own logits processors, position by position along a proposal;
- greedy output with the rules token-identical to HF `generate` with the equivalent processors;
- sampled output: the joint law of the first two tokens of a real propose/verify round is the target's
  processed law, on a bigram model whose every distribution is known in closed form;
- the draft processes q with the same rules: with the target as its own draft, every token is accepted.
"""

import numpy as np
import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

import app.speculation.drafting as drafting
import app.speculation.steps as spec
from app.engine import Engine, EngineSettings
from app.errors import InvalidRequestError
from app.speculation.logits import LogitRules
from app.params import SamplingParams, parse_sampling
from app.model.runner import ModelRunner
from app.speculation.steps import ProposeItem, VerifyItem
from conftest import blend
from test_sampling import assert_detectable, assert_law, law_of, processed

PROMPTS = ["def fib(n):", "hello world, this is a longer prompt than the others", "x", "for i in range(10):\n  "]


class OutputPenalties(LogitsProcessor):
    """The reference for presence and frequency penalties (transformers has none): vLLM's definition,
    over the tokens generated so far, written out loop by loop."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token in set(ids[self.prompt_len:]):
                scores[row, token] -= self.presence + self.frequency * ids[self.prompt_len:].count(token)
        return scores


def hf_processors(prompt_len: int, params: SamplingParams, stop_ids: list[int]) -> LogitsProcessorList:
    """transformers' processors equivalent to `params`' rules, in the same order."""
    out = []
    if params.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()}))
    if params.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, stop_ids))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        out.append(OutputPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    return LogitsProcessorList(out)


RULES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "bias": dict(logit_bias={5: 8.0, 17: -100.0, 40: 3.5}),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7, logit_bias={9: 4.0},
                min_tokens=6, stop_token_ids=[12]),
}


@pytest.mark.parametrize("name", RULES)
def test_rules_equal_transformers_processors_at_every_position_of_a_proposal(name):
    v, prompt_len = 50, 6
    gen = torch.Generator().manual_seed(3)
    history = torch.randint(0, v, (10,), generator=gen).tolist()  # 6 prompt + 4 output tokens
    new = [12, 9, history[7], 12]  # a proposal repeating output and prompt tokens
    logits = torch.randn(len(new) + 1, v, generator=gen) * 3
    params = parse_sampling(dict(max_tokens=20, **RULES[name]))
    stops = [12, 0]
    rules = LogitRules.of(params, prompt_len, frozenset(stops))
    got = rules.apply(logits, history, new)
    for j in range(len(new) + 1):
        ids = torch.tensor([history + new[:j]])
        want = hf_processors(prompt_len, params, stops)(ids, logits[j : j + 1].clone())
        torch.testing.assert_close(got[j : j + 1], want, msg=f"position {j}")
    assert not torch.equal(got, logits)  # the rules changed something


def test_min_tokens_holds_back_stop_ids_until_the_output_is_long_enough():
    params = parse_sampling(dict(max_tokens=20, min_tokens=3))
    rules = LogitRules.of(params, 2, frozenset({4}))
    out = rules.apply(torch.zeros(4, 8), [1, 1, 7], [3, 3, 3])  # 1, 2, 3, 4 output tokens before rows 0..3
    assert torch.isinf(out[:2, 4]).all() and out[:2, 4].lt(0).all()
    assert torch.isfinite(out[2:, 4]).all()
    assert LogitRules.of(parse_sampling(dict(min_tokens=3, ignore_eos=True)), 2, frozenset()) is None


def test_neutral_params_make_no_rules():
    assert LogitRules.of(SamplingParams(), 3, frozenset({0})) is None


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.04, 0.16]]))
    kept = process_min_p(logits, 0.3) > 0
    assert kept.tolist() == [[True, True, False, False, True]]  # 0.1 < 0.3 * 0.5 <= 0.16
    assert (process_min_p(logits, 0.0) > 0).all()


def process_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    from app.speculation.sampling import process_logits
    return process_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                          torch.tensor([min_p]))


@pytest.mark.parametrize("bad", [dict(logit_bias={3: 101.0}), dict(logit_bias={-1: 1.0}), dict(min_tokens=9, max_tokens=8),
                                 dict(repetition_penalty=0.0), dict(presence_penalty=2.5), dict(min_p=1.5),
                                 dict(logprobs=21)])
def test_out_of_range_controls_are_refused_by_name(bad):
    with pytest.raises(InvalidRequestError) as e:
        parse_sampling(bad)
    assert e.value.param in bad or e.value.param is None


def test_a_logit_bias_outside_the_vocabulary_is_refused(target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer))
    with pytest.raises(InvalidRequestError) as e:
        engine.new_request("x", dict(logit_bias={10_000: 1.0}))
    assert e.value.param == "logit_bias"


# ------------------------------------------------------------------ greedy identity with HF

def reference(model, prompt_ids, params: SamplingParams, stops: list[int], n: int = 24) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                         logits_processor=hf_processors(len(prompt_ids), params, stops))
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_with_rules_is_token_identical_to_hf_generate(name, k, target_model, tokenizer):
    draft = blend(target_model, 7, 0.85)
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(draft, tokenizer))
    params = parse_sampling(dict(temperature=0, max_tokens=24, ignore_eos=True, speculation={"num_tokens": k},
                                 **RULES[name]))
    stops = params.stop_token_ids
    plain = engine.generate(PROMPTS, parse_sampling(dict(temperature=0, max_tokens=24, ignore_eos=True)))
    results = engine.generate(PROMPTS, params)
    changed = 0
    for r, before in zip(results, plain):
        want = reference(target_model, r.prompt_token_ids, params, stops)
        n = len(r.token_ids)
        assert r.token_ids == want[:n]
        if n < 24:  # it stopped: at a stop id the reference emits next, never before min_tokens
            assert r.finish_reason == "stop" and want[n] in stops and n >= params.min_tokens
        changed += r.token_ids != before.token_ids
    assert changed  # the rules change the output of some prompt


# ------------------------------------------------------------------ sampled: exact, end to end

class Bigram:
    """A model runner whose next-token logits depend on the last token only (table [V, V]): every
    distribution of a round is known in closed form, so real propose() and verify() can be checked
    against the exact law."""

    def __init__(self, table: torch.Tensor):
        self.table, self.vocab_size = table, table.shape[0]
        self.grammars = None  # no grammar here: the rules alone

    def open(self, seqs):
        return _BigramBatch(self.table, seqs)

    def prefill(self, seqs, budget=None):
        return 0  # no cache to fill: every forward is a table lookup


class _BigramBatch:
    def __init__(self, table, seqs):
        self.table = table
        self.logits = [table[torch.tensor(s.token_ids[len(s.token_ids) - s.num_logits:])] for s in seqs]

    def extend(self, tokens):
        return self.table[torch.tensor(tokens)]

    def close(self, keep, extended=None):
        pass


def test_sampled_rounds_with_rules_follow_the_processed_target_law():
    v, n, k = 6, 30_000, 2
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(v, v, generator=gen) + 2.5 * torch.eye(v)  # repeats are likely: penalties matter
    draft = target + 2.0 * torch.randn(v, v, generator=gen)
    prompt = [3, 1, 3]
    params = parse_sampling(dict(temperature=0.9, max_tokens=8, frequency_penalty=1.2, presence_penalty=0.5,
                                 repetition_penalty=1.4, min_p=0.05, logit_bias={2: 1.0}, speculation={"num_tokens": k}))
    rules = LogitRules.of(params, len(prompt), frozenset())
    # the exact law of (x1, x2): p(x1 | prompt) p(x2 | prompt, x1), each processed with its history
    p1 = processed_with(rules, target[prompt[-1]], prompt, params)
    p_next = torch.stack([processed_with(rules, target[x], prompt + [x], params) for x in range(v)])
    joint = law_of(p1)[:, None] * law_of(p_next)
    # Power: a verify that ignored the draft token before position 2 (penalising with the prompt alone)
    stale = torch.stack([processed_with(rules, target[x], prompt, params) for x in range(v)])
    assert_detectable(joint.ravel(), (law_of(p1)[:, None] * law_of(stale)).ravel(), n)

    seeds = torch.arange(n) * 1_000_003 + 17
    proposals = drafting.propose(Bigram(draft), [ProposeItem(f"s{i}", prompt, k, params, int(s), rules=rules)
                                             for i, s in enumerate(seeds.tolist())])
    first, second = first_two(target, prompt, proposals, params, seeds, rules)
    assert_law(np.array(first) * v + np.array(second), joint.ravel(), tv_bound=0.03)


def first_two(target: torch.Tensor, prompt: list[int], proposals, params, seeds: torch.Tensor, rules=None):
    """The first two tokens each seed's output emits after `prompt`: its round over its proposal, and
    where that round emitted one token, the plain step after it (a bigram target `target`)."""
    verdicts = spec.verify(Bigram(target), [VerifyItem(f"s{i}", prompt, pr, params, int(s), rules=rules)
                                            for i, (pr, s) in enumerate(zip(proposals, seeds.tolist()))])
    first = [vd.tokens[0] for vd in verdicts]
    one = [i for i, vd in enumerate(verdicts) if len(vd.tokens) == 1]
    assert 0.1 < len(one) / len(verdicts) < 0.9, "both paths (rejection at slot 0, acceptance) must be exercised"
    nxt = spec.verify(Bigram(target), [VerifyItem(f"s{i}", prompt + [first[i]], spec.Proposal.empty(), params,
                                                  int(seeds[i]), rules=rules) for i in one])
    second = [vd.tokens[1] if len(vd.tokens) > 1 else None for vd in verdicts]
    for i, vd in zip(one, nxt):
        second[i] = vd.tokens[0]
    return first, second


def processed_with(rules: LogitRules, logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    ruled = rules.apply(logits.unsqueeze(0), history)
    from app.speculation.sampling import process_logits
    return process_logits(ruled, torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                          torch.tensor([params.top_p]), torch.tensor([params.min_p]))[0]


def test_the_draft_processes_q_with_the_same_rules(target_model, tokenizer, monkeypatch):
    """With the target as its own draft (q untruncated) and the rules on both sides, q = p: every draft
    token passes. Planted bug: a draft that ignores the rules proposes tokens the penalised target rejects."""
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(target_model, tokenizer), EngineSettings(draft_top_n=0))
    params = dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, speculation={"num_tokens": 4},
                  **RULES["all"])
    same = engine.generate(PROMPTS, params)
    assert all(r.speculation["acceptance_rate"] > 0.97 for r in same), [r.speculation for r in same]
    monkeypatch.setattr(drafting, "_ruled", lambda grammars, logits, items, drafted: logits)
    unruled = engine.generate(PROMPTS, params)
    assert min(r.speculation["acceptance_rate"] for r in unruled) < 0.9


# ------------------------------------------------------------------ logprobs

def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits at every position of ids, one plain forward: [len(ids), V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("k", [0, 4, "auto"])
def test_raw_logprobs_are_the_targets_at_each_emitted_token(k, target_model, tokenizer):
    draft = blend(target_model, 7, 0.85)
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(draft, tokenizer))
    results = engine.generate(PROMPTS, dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                                            speculation={"num_tokens": k}))
    for r in results:
        ids = r.prompt_token_ids + r.token_ids
        want = torch.log_softmax(full_logits(target_model, ids), -1)[len(r.prompt_token_ids) - 1 : -1]
        assert len(r.logprobs) == len(r.token_ids)
        for j, (token, (lp, top)) in enumerate(zip(r.token_ids, r.logprobs)):
            assert lp == pytest.approx(float(want[j, token]), abs=1e-4)
            values, ids_ = want[j].topk(3)
            assert [t for t, _ in top] == ids_.tolist() and top[0][0] == token  # greedy: the top one
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer))
    params = dict(temperature=0.7, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=2,
                  logprobs_mode="processed", frequency_penalty=0.5, speculation={"num_tokens": 3})
    r = engine.generate(PROMPTS[0], params)[0]
    sp = parse_sampling(params)
    rules = LogitRules.of(sp, len(r.prompt_token_ids), frozenset())
    logits = full_logits(target_model, r.prompt_token_ids + r.token_ids)
    for j, (token, (lp, top)) in enumerate(zip(r.token_ids, r.logprobs)):
        pos = len(r.prompt_token_ids) - 1 + j
        p = processed_with(rules, logits[pos], r.prompt_token_ids + r.token_ids[:j], sp)
        assert lp == pytest.approx(float(torch.log(p[token])), abs=1e-4)
        assert len(top) == 2 and top[0][1] == pytest.approx(float(torch.log(p.max())), abs=1e-4)
        assert (p > 0).sum() <= 20  # top-k truncated what it was sampled from


def test_prompt_logprobs_score_every_prompt_token_after_the_first_across_chunks(target_model, tokenizer):
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer),
                    EngineSettings(prefill_chunk=4))
    prompt = PROMPTS[1]
    r = engine.generate(prompt, dict(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2))[0]
    ids = r.prompt_token_ids
    want = torch.log_softmax(full_logits(target_model, ids), -1)
    assert len(ids) > 8 and len(r.prompt_logprobs) == len(ids) - 1
    for j, (lp, top) in enumerate(r.prompt_logprobs):
        assert lp == pytest.approx(float(want[j, ids[j + 1]]), abs=1e-4)
        assert [t for t, _ in top] == want[j].topk(2).indices.tolist()
    # scoring the prompt changes nothing the request generates
    plain = engine.generate(prompt, dict(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert plain.token_ids == r.token_ids and plain.prompt_logprobs is None
