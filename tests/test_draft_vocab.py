"""A draft that proposes from its most frequent tokens (app/speculation/draft_vocab.py), exact in every mode.

- the restricted head: the kept tokens' logits are the whole head's, the others FLOOR;
- loaded from a draft directory's ranking (EngineConfig's proposal_vocab), its proposals use kept
  tokens alone, and greedy output stays token-identical to plain target decoding;
- sampled rounds: the joint law of the first two emitted tokens is the target's, with a draft that
  cannot propose some of the target's likeliest tokens (the residual must give them their share);
- a request whose rules mask every kept token still drafts (no NaN), and the compiled-step check still
  catches a wrong head (FLOOR does not widen its tolerance).
"""

import json

import numpy as np
import torch

import app.speculation.drafting as drafting
import app.speculation.steps as spec
from app.model.compiled import agrees
from app.speculation.draft_vocab import FLOOR, RANKING, SubsetHead, restrict_head
from app.engine import Engine
from app.params import parse_sampling
from app.model.runner import ModelRunner
from app.speculation.steps import ProposeItem
from conftest import VOCAB, blend
from test_logits import Bigram, first_two
from test_sampling import assert_detectable, assert_law, law_of, processed

KEPT = list(range(2, 60))  # of the tiny tokenizer's 98: most printable ASCII, not the rest


def test_the_restricted_head_computes_the_kept_rows_alone():
    head = torch.nn.Linear(16, 40, bias=True)
    ids = torch.tensor([3, 7, 8, 30])
    sub = SubsetHead(head, ids)
    hidden = torch.randn(2, 5, 16)
    out = sub(hidden)
    assert out.shape == (2, 5, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out[..., ids], head(hidden)[..., ids])  # gemm rounds by shape
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    assert (out[..., rest] == FLOOR).all()
    assert sub.linear.weight.shape == (4, 16)  # the head streams 4 rows, not 40


def _draft_dir(tmp_path, model, tokenizer, ranking):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / RANKING).write_text(json.dumps({"how": "a test", "ranking": ranking}))
    return str(tmp_path)


def test_a_restricted_draft_proposes_kept_tokens_and_greedy_output_is_unchanged(tmp_path, target_model, tokenizer):
    ranking = KEPT + [i for i in range(VOCAB) if i not in KEPT]
    path = _draft_dir(tmp_path, blend(target_model, 7, 0.85), tokenizer, ranking)
    engine = Engine.from_pretrained(path, path, proposal_vocab=len(KEPT))  # the draft as its own target: q = p on KEPT
    draft = engine.draft.model
    assert isinstance(draft.get_output_embeddings(), SubsetHead)
    assert not isinstance(engine.target.model.get_output_embeddings(), SubsetHead)  # the target's head is whole
    # every drafted token is a kept one, greedy and sampled
    for params in (dict(temperature=0.0), dict(temperature=1.0)):
        items = [ProposeItem(f"p{i}", tokenizer.encode(f"x = {i}"), 6, parse_sampling(params), seed=i) for i in range(8)]
        for proposal in engine.draft.on_thread(drafting.propose, engine.draft, items):
            assert set(proposal.tokens) <= set(KEPT)
            assert set(proposal.q_ids[proposal.q_probs > 0].tolist()) <= set(KEPT)

    target = ModelRunner(target_model, tokenizer)
    prompts = ["def f(x):", "hello world", "{[(", "zzz ~~~"]
    plain = Engine(target).generate(prompts, dict(temperature=0.0, max_tokens=24, ignore_eos=True))
    restricted = Engine(ModelRunner(target_model, tokenizer), engine.draft)
    out = restricted.generate(prompts, dict(temperature=0.0, max_tokens=24, ignore_eos=True,
                                            speculation={"num_tokens": 4}))
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert sum(r.speculation["accepted_tokens"] for r in out) > 0  # it speculated, and some drafts passed
    assert any(t not in KEPT for r in out for t in r.token_ids)  # the target emitted tokens the draft cannot


def test_a_draft_without_a_ranking_keeps_its_whole_head(tmp_path, target_model, tokenizer, caplog):
    model = blend(target_model, 7, 0.85)
    model.save_pretrained(tmp_path)
    assert restrict_head(model, str(tmp_path), 10) == VOCAB
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear) and "token_ranking.json" in caplog.text


def test_sampled_rounds_with_a_restricted_draft_follow_the_target_law():
    v, n, k = 6, 30_000, 2
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(v, v, generator=gen) + 2.0 * torch.eye(v)
    kept = torch.tensor([0, 2, 3])  # tokens 1, 4, 5 the draft never proposes; token x is p's likeliest after x
    head = torch.nn.Linear(v, v, bias=False)
    with torch.no_grad():
        head.weight.copy_((target + 0.5 * torch.randn(v, v, generator=gen)).T)  # row x of the table: logits after x
    draft = SubsetHead(head, kept)(torch.eye(v)).detach()
    assert (draft[:, [1, 4, 5]] == FLOOR).all()
    prompt = [1, 4]
    params = parse_sampling(dict(temperature=1.0, max_tokens=8, repetition_penalty=1.3, speculation={"num_tokens": k}))
    from app.speculation.logits import LogitRules
    rules = LogitRules.of(params, len(prompt), frozenset())
    from test_logits import processed_with
    p1 = processed_with(rules, target[prompt[-1]], prompt, params)
    p_next = torch.stack([processed_with(rules, target[x], prompt + [x], params) for x in range(v)])
    joint = law_of(p1)[:, None] * law_of(p_next)
    # Power: a verify that took q's zeros for "never emitted" would emit only kept tokens
    q_only = joint.copy()
    q_only[[1, 4, 5], :] = 0
    q_only[:, [1, 4, 5]] = 0
    assert_detectable(joint.ravel(), (q_only / q_only.sum()).ravel(), n)

    seeds = torch.arange(n) * 1_000_003 + 29
    proposals = drafting.propose(Bigram(draft), [ProposeItem(f"s{i}", prompt, k, params, int(s), rules=rules)
                                             for i, s in enumerate(seeds.tolist())])
    assert {t for pr in proposals for t in pr.tokens} <= set(kept.tolist())
    first, second = first_two(target, prompt, proposals, params, seeds, rules)
    assert_law(np.array(first) * v + np.array(second), joint.ravel(), tv_bound=0.03)


def test_rules_that_mask_every_kept_token_leave_the_draft_a_finite_distribution():
    logits = torch.full((2, 8), FLOOR)
    logits[:, :3] = -float("inf")  # the kept tokens 0-2, all masked by a grammar
    items = [ProposeItem(f"s{i}", [1, 2], 1, parse_sampling(dict(temperature=0.5)), seed=i) for i in range(2)]
    sampling = spec.sampling_tensors([it.sampling for it in items], logits.device)
    tokens, q_ids, q_probs = drafting._draft_step(logits, items, torch.tensor([2, 2]), 0, sampling, torch.tensor([1, 2]))
    assert torch.isfinite(q_probs).all() and (tokens >= 3).all()
    torch.testing.assert_close(q_probs, torch.full((2, 8), 1 / 5).where(q_ids >= 3, torch.zeros(2, 8)))
    assert (processed(logits[0], temperature=0.5)[3:] > 0).all()


def test_the_compiled_check_still_sees_a_wrong_head_beside_floor_logits():
    eager = torch.full((2, 10), FLOOR)
    eager[:, :4] = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, -1.0, 4.0, 2.0]])
    assert agrees(eager, eager.clone(), torch.float32)[0]
    wrong = eager.clone()
    wrong[:, :4] *= 1.5  # a head that scales: off by far more than rounding
    assert not agrees(eager, wrong, torch.float32)[0]


def test_the_ranking_puts_what_the_draft_proposes_first(target_model):
    """specserve.demo.distill.token_ranking: the draft's argmax counts first, then the text's own counts, then id order."""
    from specserve.demo.distill import token_ranking

    draft = blend(target_model, 7, 0.85)
    texts = [[5, 9, 9, 30, 31, 5], [40, 41, 42, 43, 44, 45, 46, 47, 9]]
    ranking = token_ranking(draft, texts, window=4, batch=3)
    assert sorted(ranking) == list(range(VOCAB))
    proposed = torch.zeros(VOCAB, dtype=torch.long)
    with torch.no_grad():
        for ids in texts:
            for start in range(0, len(ids), 4):  # each window alone, as the ranking reads them
                proposed += torch.bincount(draft(torch.tensor([ids[start: start + 4]])).logits[0].argmax(-1),
                                           minlength=VOCAB)
    chosen = int((proposed > 0).sum())
    assert [int(proposed[t]) for t in ranking[:chosen]] == sorted(proposed[proposed > 0].tolist(), reverse=True)
    shown = [t for t in ranking[chosen:] if any(t in ids for ids in texts)]
    assert ranking[chosen: chosen + len(shown)] == shown  # then tokens the text shows, before the rest
    assert ranking[chosen + len(shown):] == sorted(ranking[chosen + len(shown):])  # the rest in id order


def test_greedy_proposals_over_the_kept_tokens_alone_are_those_over_the_whole_width(tmp_path, target_model,
                                                                                    tokenizer, monkeypatch):
    """Greedy rows without rules take their argmax, runner-ups and confidence over a restricted head's kept
    tokens alone (a third of the width on the reference draft): the same tokens, guesses, runner-ups and
    lengths as over the whole width, where the others are FLOOR."""
    ranking = KEPT + [i for i in range(VOCAB) if i not in KEPT]
    path = _draft_dir(tmp_path, blend(target_model, 7, 0.85), tokenizer, ranking)
    draft = Engine.from_pretrained(path, path, proposal_vocab=len(KEPT)).draft
    greedy = parse_sampling(dict(temperature=0.0))
    asks = [ProposeItem(f"p{i}", tokenizer.encode(f"x = {i} +"), 5, greedy, seed=i, guess=True, runner_ups=2,
                        stop_below=0.2 * (i % 3)) for i in range(6)]
    narrowed = []
    kept_ids = drafting._kept_ids
    monkeypatch.setattr(drafting, "_kept_ids", lambda runner: narrowed.append(kept_ids(runner)) or narrowed[-1])
    kept = draft.on_thread(drafting.propose, draft, asks)
    assert narrowed and all(ids is not None and ids.tolist() == KEPT for ids in narrowed)  # the narrow path ran
    monkeypatch.setattr(drafting, "_kept_ids", lambda runner: None)  # every step over the whole width
    for it in asks:
        draft.release(it.seq_id)
    whole = draft.on_thread(drafting.propose, draft, asks)
    assert [(p.tokens, p.guess, p.runner_ups) for p in kept] == [(p.tokens, p.guess, p.runner_ups) for p in whole]
    assert any(len(p.tokens) < 5 for p in kept) and any(len(p.tokens) == 5 for p in kept)  # lengths decided
    assert all(set(p.tokens + [p.guess]) <= set(KEPT) for p in kept)
