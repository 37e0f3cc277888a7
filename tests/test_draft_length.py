"""A proposal that ends where the draft is unsure (ProposeItem.stop_below, the speculation setting
draft_stop_below), exact in every mode.

- its length: up to and including the first token whose top draft probability is below the bound,
  at most k; the guess is the draft's next token there; a row's proposal is the same in any batch;
- the draft stops stepping once every row has what it needs (on a CPU);
- sampled rounds keep the target's joint law; greedy output stays token-identical to plain decoding.
"""

import numpy as np
import torch

import app.speculation.drafting as drafting
import app.speculation.steps as spec
from app.engine import Engine, EngineSettings
from app.params import parse_sampling
from app.model.runner import ModelRunner
from app.speculation.steps import ProposeItem, VerifyItem
from conftest import blend
from test_logits import Bigram
from test_sampling import assert_law, law_of

V = 6
GEN = torch.Generator().manual_seed(21)
# next-token logits after each token: sure after 0-2 (one logit far above), unsure after 3-5
TABLE = torch.randn(V, V, generator=GEN)
TABLE[[0, 1, 2], [1, 2, 3]] += 9.0
GREEDY = parse_sampling(dict(temperature=0.0, max_tokens=16))


def greedy_chain(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n):
        out.append(int(TABLE[out[-1]].argmax()))
    return out[1:]


def top_prob(token: int) -> float:
    return float(TABLE[token].softmax(-1).max())


class Counting(Bigram):
    """A bigram draft that counts its steps (extend calls)."""

    def __init__(self, table):
        super().__init__(table)
        self.steps = 0

    def open(self, seqs):
        batch = super().open(seqs)
        extend = batch.extend

        def counted(tokens):
            self.steps += 1
            return extend(tokens)
        batch.extend = counted
        return batch


def test_a_greedy_proposal_ends_after_the_first_unsure_token():
    chain = greedy_chain(0, 8)  # 1, 2, 3, then tokens drawn after the unsure 3
    assert chain[:3] == [1, 2, 3] and top_prob(0) > 0.9 and top_prob(3) < 0.9
    draft = Counting(TABLE)
    item = ProposeItem("a", [5, 0], 6, GREEDY, 0, guess=True, stop_below=0.9)
    (proposal,) = drafting.propose(draft, [item])
    # the draft was sure of 1, 2 and 3 (after 0, 1, 2) and unsure of the token after 3
    assert proposal.tokens == chain[:4] and proposal.guess == chain[4]
    assert draft.steps == 4  # five steps' tokens (four and the guess): four extends, not six
    (whole,) = drafting.propose(Bigram(TABLE), [ProposeItem("b", [5, 0], 6, GREEDY, 0, guess=True)])
    assert whole.tokens == chain[:6] and whole.guess == chain[6]  # no bound: all k
    (loose,) = drafting.propose(Bigram(TABLE), [ProposeItem("c", [5, 0], 3, GREEDY, 0, guess=True, stop_below=0.01)])
    assert loose.tokens == chain[:3] and loose.guess == chain[3]  # k bounds it first


def dense(proposal) -> torch.Tensor:
    return torch.zeros(len(proposal.tokens), V).scatter_add_(1, proposal.q_ids, proposal.q_probs)


def test_each_row_keeps_its_own_length_in_a_batch():
    params = parse_sampling(dict(temperature=0.8, max_tokens=16))
    items = [ProposeItem("g", [5, 0], 6, GREEDY, 0, guess=True, stop_below=0.9),
             ProposeItem("s", [4, 1], 5, params, 77, guess=True, stop_below=0.5),
             ProposeItem("n", [2], 3, GREEDY, 0, guess=True),
             ProposeItem("u", [3], 4, params, 5, stop_below=0.95)]
    together = drafting.propose(Bigram(TABLE), items)
    for item, proposal in zip(items, together):
        (alone,) = drafting.propose(Bigram(TABLE), [item])
        assert (proposal.tokens, proposal.guess) == (alone.tokens, alone.guess)
        torch.testing.assert_close(dense(proposal), dense(alone))  # a greedy row's q is one-hot either way
    assert len(together[0].tokens) == 4 and len(together[2].tokens) == 3
    assert together[3].guess is None and 1 <= len(together[3].tokens) <= 4


def test_sampled_rounds_with_unsure_stops_follow_the_target_law():
    n, k = 30_000, 3
    target = torch.randn(V, V, generator=GEN) + 1.5 * torch.eye(V)
    prompt = [2, 4]  # after 4 the draft is unsure, but above the bound: the second token decides where it stops
    params = parse_sampling(dict(temperature=1.0, max_tokens=8))
    seeds = torch.arange(n) * 1_000_003 + 41
    items = [ProposeItem(f"s{i}", prompt, k, params, int(s), stop_below=0.37) for i, s in enumerate(seeds.tolist())]
    proposals = drafting.propose(Bigram(TABLE), items)
    lengths = np.bincount([len(p.tokens) for p in proposals])
    assert lengths[2] > 0.1 * n and lengths[k] > 0.1 * n  # both stops exercised: early, and at k
    verdicts = spec.verify(Bigram(target), [VerifyItem(f"s{i}", prompt, pr, params, int(s))
                                            for i, (pr, s) in enumerate(zip(proposals, seeds.tolist()))])
    first = [vd.tokens[0] for vd in verdicts]
    one = [i for i, vd in enumerate(verdicts) if len(vd.tokens) == 1]
    nxt = spec.verify(Bigram(target), [VerifyItem(f"s{i}", prompt + [first[i]], spec.Proposal.empty(), params,
                                                  int(seeds[i])) for i in one])
    second = [vd.tokens[1] if len(vd.tokens) > 1 else None for vd in verdicts]
    for i, vd in zip(one, nxt):
        second[i] = vd.tokens[0]
    p = law_of(target.softmax(-1))
    assert_law(np.array(first) * V + np.array(second), (p[prompt[-1]][:, None] * p).ravel(), tv_bound=0.03)


def test_greedy_output_with_unsure_stops_is_plain_decoding(target_model, tokenizer):
    prompts = ["def f(x):", "hello world", "{[(", "zzz ~~~"]
    plain = Engine(ModelRunner(target_model, tokenizer)).generate(prompts, dict(temperature=0.0, max_tokens=24,
                                                                                ignore_eos=True))
    from app.speculation.draft_policy import DraftPolicy
    engine = Engine(ModelRunner(target_model, tokenizer), ModelRunner(blend(target_model, 7, 0.85), tokenizer),
                    EngineSettings(policy=DraftPolicy(ahead=False, stop_below=0.7)))
    out = engine.generate(prompts, dict(temperature=0.0, max_tokens=24, ignore_eos=True, speculation={"num_tokens": 6}))
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    drafted = sum(r.speculation["drafted_tokens"] for r in out)
    rounds = sum(r.speculation["drafted_rounds"] for r in out)
    assert 0 < drafted < 6 * rounds  # some proposals ended before K


def test_off_a_cpu_the_steps_read_nothing_until_the_end(target_model, tokenizer, monkeypatch):
    """Where a read stalls the device (a GPU) the steps run to k with no read between them, and each
    row's length comes back with its tokens in the one copy: the same reads as a fixed-K proposal."""
    from app.model.syncs import SyncCounter

    draft = ModelRunner(blend(target_model, 7, 0.9), tokenizer)
    asks = [ProposeItem(f"s{i}", list(range(3 + i, 30)), 4, GREEDY, seed=i, guess=True) for i in range(3)]
    bounded = [ProposeItem(a.seq_id, a.token_ids, 4, GREEDY, a.seed, guess=True, stop_below=0.5) for a in asks]
    on_cpu = drafting.propose(draft, bounded)
    drafting.propose(draft, asks)
    with SyncCounter() as fixed:
        drafting.propose(draft, asks)
    monkeypatch.setattr(drafting.Lengths, "done", lambda self, step: False)  # as off a CPU
    with SyncCounter() as syncs:
        proposals = drafting.propose(draft, bounded)
    assert syncs.by_call == fixed.by_call, syncs.by_call
    assert [(p.tokens, p.guess) for p in proposals] == [(p.tokens, p.guess) for p in on_cpu]
    assert any(len(p.tokens) < 4 for p in proposals)  # some stopped early, with the same tokens as on a CPU


def test_a_branching_row_that_stops_at_once_keeps_its_guess_and_runner_ups():
    """A greedy row asking for runner-ups (drafting ahead for rejections) that stops after its first
    token: two steps run, not k + 1, and its guess and runner-ups are read where they lie."""
    chain = greedy_chain(4, 2)
    assert top_prob(4) < 0.9
    draft = Counting(TABLE)
    (proposal,) = drafting.propose(draft, [ProposeItem("r", [5, 4], 6, GREEDY, 0, guess=True, runner_ups=2, stop_below=0.9)])
    assert proposal.tokens == chain[:1] and proposal.guess == chain[1] and draft.steps == 1
    assert proposal.runner_ups == [TABLE[4].topk(3).indices[1:].tolist()]
