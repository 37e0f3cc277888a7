"""Sampling and the rejection sampler: processed distributions, addressable uniforms, hand-built
acceptance cases, and the statistical proof that a speculative round emits exactly the target's law."""

import numpy as np
import pytest
import torch
from scipy import stats

from app.speculation.sampling import ACCEPT, DRAFT, EMIT, process_logits, rejection_sample, sample, uniform

ALPHA = 1e-3  # chi-square / KS p-values below this fail; every seed is fixed, so nothing is flaky


# ---------------------------------------------------------------- helpers


def params(n: int, temperature=1.0, top_k=0, top_p=1.0):
    """(temperature [n], top_k [n], top_p [n]) with one value for every row."""
    return torch.full((n,), float(temperature)), torch.full((n,), int(top_k)), torch.full((n,), float(top_p))


def dense_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, K, V] as the sparse (q_ids, q_probs) pair with M = V."""
    ids = torch.arange(q.shape[-1]).expand(q.shape).contiguous()
    return ids, q.float()


def run(p, draft, q, num_draft=None, greedy=False, seeds=None, start_pos=None):
    """rejection_sample with defaults, checking the output contract (padding, drafted prefix) on the way.

    p [B, K+1, V]; draft [B, K]; q [B, K, V] dense, or a (q_ids, q_probs) pair.
    """
    b, k1, _ = p.shape
    q_ids, q_probs = q if isinstance(q, tuple) else dense_q(q)
    num_draft = torch.full((b,), k1 - 1) if num_draft is None else torch.as_tensor(num_draft)
    greedy = torch.as_tensor(greedy).expand(b).clone()
    seeds = torch.arange(b) if seeds is None else torch.as_tensor(seeds)
    start_pos = torch.full((b,), 5) if start_pos is None else torch.as_tensor(start_pos)
    accepted, tokens = rejection_sample(p.float(), draft.long(), q_ids.long(), q_probs, num_draft, greedy,
                                        seeds.long(), start_pos.long())
    assert accepted.shape == (b,) and tokens.shape == (b, k1)
    assert bool(((accepted >= 0) & (accepted <= num_draft)).all())
    slot = torch.arange(k1)
    emitted = slot < accepted.unsqueeze(1) + 1
    assert bool((tokens[~emitted] == -1).all()), "padding past accepted + 1 must be -1"
    assert bool((tokens[emitted] >= 0).all())
    prefix = slot[:-1] < accepted.unsqueeze(1)
    assert bool((tokens[:, :-1][prefix] == draft[prefix]).all()), "accepted tokens are the drafted ones"
    return accepted, tokens


def one_hot(ids, v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.as_tensor(ids), v).float()


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit on the support of probs, merging cells expected below min_expected."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, f"{counts[probs == 0].sum()} draws outside the support"
    counts, expected = counts[probs > 0], probs[probs > 0] * n
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    small = np.cumsum(expected) < min_expected * 2  # the smallest cells, pooled into one
    if small.any():
        cut = small.sum() + 1
        counts = np.concatenate([[counts[:cut].sum()], counts[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    if len(expected) < 2:
        return 1.0
    return float(stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue)


def assert_law(samples: np.ndarray, probs: np.ndarray, tv_bound: float = 0.02) -> None:
    """samples (ints in [0, len(probs))) follow probs: chi-square and a total-variation bound."""
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    assert tv < tv_bound, f"total variation {tv:.4f} >= {tv_bound}"
    p = chisq_pvalue(counts, probs)
    assert p > ALPHA, f"chi-square p = {p:.2e}"


def assert_detectable(law: np.ndarray, wrong: np.ndarray, n: int, sigmas: float = 5.0) -> None:
    """The test has power: a buggy law moves some cell by more than `sigmas` standard errors at n draws."""
    se = np.sqrt(np.clip(law * (1 - law), 1e-12, None) / n)
    z = np.abs(wrong - law) / se
    assert z.max() > sigmas, f"a bug would shift cells by only {z.max():.1f} sigma"


# ---------------------------------------------------------------- process_logits


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -2.0, 1.5, 0.2]])


def test_greedy_rows_are_one_hot_at_argmax_whatever_the_other_params():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    t, k, p = params(6, temperature=0.0, top_k=3, top_p=0.5)
    probs = process_logits(logits, t, k, p)
    assert torch.equal(probs, one_hot(logits.argmax(-1), 11))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    probs = process_logits(LOGITS, *params(1, temperature))
    torch.testing.assert_close(probs, torch.softmax(LOGITS / temperature, -1))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k_tokens_renormalised(k):
    probs = process_logits(LOGITS, *params(1, 0.8, top_k=k))[0]
    kept = probs > 0
    assert int(kept.sum()) == k
    assert set(kept.nonzero().flatten().tolist()) == set(LOGITS[0].topk(k).indices.tolist())
    torch.testing.assert_close(probs[kept], torch.softmax(LOGITS[0][kept] / 0.8, -1))


@pytest.mark.parametrize("k", [0, -1, 8, 50])
def test_top_k_off_or_at_least_vocab_keeps_all(k):
    torch.testing.assert_close(process_logits(LOGITS, *params(1, top_k=k)), torch.softmax(LOGITS, -1))


@pytest.mark.parametrize("top_p, kept", [(0.3, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # masses 0.5, 0.3, 0.15, 0.05 (sorted); thresholds kept away from the cumulative sums' rounding
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = process_logits(logits, *params(1, top_p=top_p))[0]
    assert set(probs.nonzero().flatten().tolist()) == kept
    mass = torch.tensor([0.5, 0.3, 0.15, 0.05])[sorted(kept)]
    torch.testing.assert_close(probs[sorted(kept)], mass / mass.sum())


@pytest.mark.parametrize("top_p", [1e-6, 0.01])
def test_top_p_always_keeps_one_token(top_p):
    logits = torch.zeros(3, 5)  # a flat row: ties everywhere
    logits[1, 2] = 1.0
    probs = process_logits(logits, *params(3, top_p=top_p))
    assert torch.isfinite(probs).all()
    assert ((probs > 0).sum(-1) == 1).all()
    assert probs[1, 2] == 1.0


def test_mixed_rows_each_get_their_own_params():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(1)) * 2
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 3, 1.0), (1.3, 0, 0.6), (0.7, 5, 0.8)]
    t, k, p = (torch.tensor(c) for c in zip(*rows))
    batched = process_logits(logits, t, k, p)
    for i, (ti, ki, pi) in enumerate(rows):
        alone = process_logits(logits[i : i + 1], *params(1, ti, ki, pi))
        torch.testing.assert_close(batched[i : i + 1], alone)
    assert torch.equal(batched[0], one_hot(logits[0].argmax(), 12))
    assert int((batched[2] > 0).sum()) == 3


def test_top_p_one_keeps_the_tail_whatever_the_batch():
    logits = torch.tensor([[10.0, 0.0, -12.0], [10.0, 0.0, -12.0]])
    alone = process_logits(logits[:1], *params(1))
    batched = process_logits(logits, torch.ones(2), torch.tensor([0, 2]), torch.ones(2))
    assert alone[0, 2] > 0
    assert batched[0, 2] > 0, "a token of positive probability became impossible because of another row"


# ---------------------------------------------------------------- uniform


def test_uniform_in_unit_interval_and_uniform():
    n = 100_000
    seeds = torch.arange(n) * 7919 - 50_000  # negative seeds too
    u = uniform(seeds, torch.full((n,), 3), DRAFT)
    assert u.dtype == torch.float64 and u.shape == (n,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > ALPHA
    # consecutive positions of one seed, the other way a sequence walks through the hash
    u_pos = uniform(torch.full((n,), 42), torch.arange(n), ACCEPT)
    assert stats.kstest(u_pos.numpy(), "uniform").pvalue > ALPHA
    # purposes at one address are independent of each other
    u_emit = uniform(seeds, torch.full((n,), 3), EMIT)
    assert abs(np.corrcoef(u.numpy(), u_emit.numpy())[0, 1]) < 0.02


def test_uniform_extreme_inputs_stay_in_range():
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 1, 12345])
    u = uniform(seeds, torch.tensor([0, 2**40, 1, 0, 2**62, 7]), EMIT)
    assert bool(((u >= 0) & (u < 1)).all())


def test_uniform_is_addressed_not_streamed():
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**40), 2**40, (64,), generator=gen)
    pos = torch.randint(0, 4096, (64,), generator=gen)
    full = uniform(seeds, pos, ACCEPT)
    perm = torch.randperm(64, generator=gen)
    assert torch.equal(uniform(seeds[perm], pos[perm], ACCEPT), full[perm])
    for i in (0, 17, 63):
        assert torch.equal(uniform(seeds[i : i + 1], pos[i : i + 1], ACCEPT), full[i : i + 1])
    # doubled batch: the same address twice gives the same value twice
    assert torch.equal(uniform(seeds.repeat(2), pos.repeat(2), ACCEPT), full.repeat(2))


def test_uniform_differs_by_seed_position_and_purpose():
    seeds, pos = torch.arange(1000), torch.full((1000,), 5000)
    base = uniform(seeds, pos, DRAFT)
    assert len(set(base.tolist())) == 1000
    for other in (uniform(seeds, pos, ACCEPT), uniform(seeds, pos, EMIT), uniform(seeds, pos + 1, DRAFT),
                  uniform(seeds + 1000, pos, DRAFT)):
        assert not bool((other == base).any())
    # seed and position are not interchangeable
    assert not bool((uniform(pos, seeds, DRAFT) == base).any())


def test_sample_inverts_the_cdf_and_skips_zero_columns():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(4, 4)
    u = torch.tensor([0.0, 0.49, 0.5, 0.999999])
    assert sample(probs, u).tolist() == [1, 1, 3, 3]
    # unnormalised weights are fine
    assert sample(torch.tensor([[2.0, 6.0]]), torch.tensor([0.26])).tolist() == [1]


# ---------------------------------------------------------------- rejection_sample, hand-built

V = 6


def test_greedy_perfect_match_accepts_all_and_adds_the_bonus():
    argmax = [3, 1, 4, 2]  # p's argmax at the 3 draft slots and the bonus slot
    p = one_hot(argmax, V).unsqueeze(0)
    draft = torch.tensor([argmax[:3]])
    accepted, tokens = run(p, draft, one_hot(argmax[:3], V).unsqueeze(0), greedy=True)
    assert accepted.tolist() == [3] and tokens.tolist() == [argmax]


def test_random_perfect_match_accepts_all_and_bonus_comes_from_p_at_k():
    # p == q at every draft slot (not one-hot): u * q < p holds for every u < 1
    gen = torch.Generator().manual_seed(4)
    n, k = 500, 3
    pq = torch.softmax(torch.randn(k, V, generator=gen), -1)
    p = torch.cat([pq, one_hot([[5]], V)[0]]).expand(n, k + 1, V)
    draft = torch.randint(0, V, (n, k), generator=gen)
    accepted, tokens = run(p, draft, pq.expand(n, k, V))
    assert (accepted == k).all()
    assert (tokens[:, k] == 5).all()


def test_greedy_early_mismatch_recovers_the_target_argmax():
    argmax = [3, 1, 4, 2, 0]
    p = one_hot(argmax, V).unsqueeze(0)
    draft = torch.tensor([[3, 1, 5, 2]])  # slot 2 disagrees
    accepted, tokens = run(p, draft, one_hot([3, 1, 5, 2], V).unsqueeze(0), greedy=True)
    assert accepted.tolist() == [2]
    assert tokens.tolist() == [[3, 1, 4, -1, -1]]


def test_greedy_mismatch_at_slot_zero():
    p = one_hot([2, 2, 2], V).unsqueeze(0)
    accepted, tokens = run(p, torch.tensor([[0, 2]]), one_hot([0, 2], V).unsqueeze(0), greedy=True)
    assert accepted.tolist() == [0] and tokens.tolist() == [[2, -1, -1]]


def test_all_rejected_emits_from_the_residual_only():
    # p(x) = 0 at every drafted token: slot 0 always rejects; the recovered token follows
    # norm(max(0, p - q)) = norm([0, 0, .3, .1, .2, 0]) and never lands where p <= q
    n = 4000
    p0 = torch.tensor([0.0, 0.1, 0.4, 0.3, 0.2, 0.0])
    q0 = torch.tensor([0.5, 0.3, 0.1, 0.2, 0.0, 0.0])
    p = torch.stack([p0, p0, p0]).expand(n, 3, V)
    draft = torch.zeros(n, 2, dtype=torch.long)
    accepted, tokens = run(p, draft, torch.stack([q0, q0]).expand(n, 2, V))
    assert (accepted == 0).all()
    residual = (p0 - q0).clamp(min=0)
    assert (residual[tokens[:, 0]] > 0).all(), "emitted a token where p <= q"
    assert_law(tokens[:, 0].numpy(), (residual / residual.sum()).numpy(), tv_bound=0.04)


def test_bonus_token_comes_from_the_last_slot():
    # the bonus slot's support {4, 5} is disjoint from the draft slots': a wrong slot would show
    n, k = 4000, 2
    pq = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0, 0.2, 0.8, 0, 0, 0]])
    bonus = torch.tensor([0, 0, 0, 0, 0.25, 0.75])
    p = torch.cat([pq, bonus[None]]).expand(n, k + 1, V)
    draft = torch.tensor([[0, 2]]).expand(n, k)
    accepted, tokens = run(p, draft, pq.expand(n, k, V))
    assert (accepted == k).all()
    assert_law(tokens[:, k].numpy(), bonus.numpy(), tv_bound=0.04)


def test_q_zero_at_drafted_token_accepts_iff_p_positive():
    # the ratio p/q is infinite where p > 0, undefined (reject) where p = 0
    n = 300
    p0 = torch.tensor([0.0, 0.3, 0.3, 0.4, 0.0, 0.0])
    q0 = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    p = torch.stack([p0, p0]).expand(n, 2, V)
    q = q0.expand(n, 1, V)
    acc1, _ = run(p, torch.ones(n, 1), q)  # p(1) = 0.3 > 0 = q(1)
    acc0, tok0 = run(p, torch.zeros(n, 1), q)  # p(0) = 0 = q(0)
    assert (acc1 == 1).all()
    assert (acc0 == 0).all()
    assert (tok0[:, 0] == 1).all(), "the residual max(0, p - q) is all on token 1"


def test_empty_residual_falls_back_to_p():
    # p <= q everywhere at the rejection slot (q here is not normalised, as rounding can leave it):
    # max(0, p - q) = 0, so the recovered token must come from p itself, never NaN or padding
    n = 3000
    p0 = torch.tensor([0.0, 0.4, 0.0, 0.6, 0.0, 0.0])
    q0 = torch.tensor([0.1, 0.4, 0.0, 0.6, 0.0, 0.0])
    p = torch.stack([p0, p0]).expand(n, 2, V)
    accepted, tokens = run(p, torch.zeros(n, 1), q0.expand(n, 1, V))
    assert (accepted == 0).all()
    assert_law(tokens[:, 0].numpy(), p0.numpy(), tv_bound=0.04)


def test_k_zero_rows_sample_p_at_slot_zero():
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 3
    p = torch.softmax(torch.randn(n, k + 1, V, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(n, k, V, generator=gen), -1)
    draft = torch.randint(0, V, (n, k), generator=gen)
    seeds, start = torch.arange(n) + 100, torch.randint(0, 500, (n,), generator=gen)
    accepted, tokens = run(p, draft, q, num_draft=torch.zeros(n, dtype=torch.long), seeds=seeds, start_pos=start)
    assert (accepted == 0).all()
    assert torch.equal(tokens[:, 0], sample(p[:, 0], uniform(seeds, start, EMIT)))
    # the same with a batch whose K is 0
    accepted0, tokens0 = run(p[:, :1], draft[:, :0], q[:, :0], seeds=seeds, start_pos=start)
    assert torch.equal(tokens0[:, 0], tokens[:, 0])


def test_greedy_k_zero_is_the_argmax():
    p = one_hot([[4], [1]], V)
    accepted, tokens = run(p, torch.zeros(2, 0), torch.zeros(2, 0, V), greedy=True)
    assert accepted.tolist() == [0, 0] and tokens.tolist() == [[4], [1]]


def random_case(n: int, k: int, seed: int, overlap: float = 2.0):
    """n rows of random p [n, k+1, V], q [n, k, V] and draft tokens sampled from q (so some are accepted)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k + 1, V, generator=gen) * 2
    p = torch.softmax(base, -1)
    q = torch.softmax(base[:, :k] + torch.randn(n, k, V, generator=gen) * overlap, -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(n, k)
    return p, q, draft


def test_ragged_batch_rows_equal_each_row_alone():
    n, k = 60, 4
    p, q, draft = random_case(n, k, seed=6, overlap=1.0)
    num_draft = torch.tensor([0, 2, 4] * (n // 3))
    greedy = torch.arange(n) % 5 == 4
    p = torch.where(greedy.view(n, 1, 1), one_hot(p.argmax(-1), V), p)
    seeds, start = torch.arange(n) * 31 + 7, torch.arange(n) * 3
    # padded slots carry junk, as a batch built from shorter rows may
    draft = torch.where(torch.arange(k) < num_draft.unsqueeze(1), draft, -1)
    accepted, tokens = run(p, draft, q, num_draft, greedy, seeds, start)
    assert set(accepted.tolist()) > {0, 1}, "the case should accept some drafts"
    for i in range(n):
        ki = int(num_draft[i])
        a, t = run(p[i : i + 1, : ki + 1], draft[i : i + 1, :ki], q[i : i + 1, :ki], None, bool(greedy[i]),
                   seeds[i : i + 1], start[i : i + 1])
        assert int(a) == int(accepted[i])
        assert t[0].tolist() == tokens[i, : ki + 1].tolist()
    # reversed order, same per-row answers; a second call is identical
    perm = torch.arange(n).flip(0)
    a_r, t_r = run(p[perm], draft[perm], q[perm], num_draft[perm], greedy[perm], seeds[perm], start[perm])
    assert torch.equal(a_r, accepted[perm]) and torch.equal(t_r, tokens[perm])
    assert torch.equal(run(p, draft, q, num_draft, greedy, seeds, start)[1], tokens)


def test_sparse_q_equals_dense_q():
    n, k, m = 400, 3, 3
    p, q, _ = random_case(n, k, seed=8)
    # keep q's top m tokens (an exactly sparse q), pad to M = m + 2 with id 0 and probability 0 as verify does
    top_p, top_i = q.topk(m, -1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    q_ids = torch.cat([top_i, torch.zeros(n, k, 2, dtype=torch.long)], -1)
    q_probs = torch.cat([top_p, torch.zeros(n, k, 2)], -1)
    shuffle = torch.randperm(m + 2, generator=torch.Generator().manual_seed(9))
    q_ids, q_probs = q_ids[..., shuffle], q_probs[..., shuffle]
    dense = torch.zeros(n, k, V).scatter_add_(-1, q_ids, q_probs)
    col = sample(top_p.reshape(-1, m), uniform(torch.arange(n * k), torch.zeros(n * k), DRAFT))
    draft = top_i.reshape(-1, m).gather(-1, col.unsqueeze(-1)).view(n, k)
    acc_s, tok_s = run(p, draft, (q_ids, q_probs))
    acc_d, tok_d = run(p, draft, dense)
    assert torch.equal(acc_s, acc_d) and torch.equal(tok_s, tok_d)
    assert 0 < float(acc_s.float().mean()) < k


# ---------------------------------------------------------------- statistical exactness

SV = 10  # vocabulary of the statistical tests
N = 40_000  # rows per simulation, each its own seed
TARGET = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.6, 0.3, 0.0, -0.4, -0.8, -1.5])
DRAFT_LOGITS = torch.tensor([-1.0, 0.2, 1.8, 0.0, 1.5, 0.4, 1.0, -0.5, 0.9, 0.3])  # disagrees with TARGET


def processed(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """process_logits over a [..., V] tensor of logits with one set of params."""
    flat = logits.reshape(-1, logits.shape[-1])
    return process_logits(flat, *params(flat.shape[0], temperature, top_k, top_p)).view(logits.shape)


def truncate(q: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., V] restricted to its top m tokens and renormalised: the sparse q the draft really samples."""
    probs, ids = q.topk(m, -1)
    return ids, probs / probs.sum(-1, keepdim=True)


def draw(q_ids: torch.Tensor, q_probs: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Draft tokens exactly as the draft draws them. q_ids, q_probs [N, M]; seeds, pos [N] -> [N]."""
    col = sample(q_probs, uniform(seeds, pos, DRAFT))
    return q_ids.gather(-1, col.unsqueeze(-1)).squeeze(-1)


def law_of(probs: torch.Tensor) -> np.ndarray:
    """float32 probabilities as float64 rows that sum to 1, for the exact algebra."""
    x = probs.double().numpy()
    return x / x.sum(-1, keepdims=True)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.clip(p - q, 0, None)
    return r / r.sum()


# (target params, draft params, top-N truncation of q or None)
FIRST_TOKEN_CASES = {
    "t1": (dict(temperature=1.0), dict(temperature=1.0), None),
    "t0.7_topk5": (dict(temperature=0.7, top_k=5), dict(temperature=1.2), None),
    "top_p0.8": (dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, top_k=6), None),
    "t1_sparse_q": (dict(temperature=1.0), dict(temperature=1.0), 4),
    "t0.7_topk5_sparse_q": (dict(temperature=0.7, top_k=5), dict(temperature=1.5, top_p=0.9), 3),
}


@pytest.mark.parametrize("case", FIRST_TOKEN_CASES)
def test_first_emitted_token_follows_processed_p(case):
    target_params, draft_params, top_n = FIRST_TOKEN_CASES[case]
    k = 2
    p = processed(TARGET, **target_params)
    q = processed(DRAFT_LOGITS, **draft_params)
    q_ids, q_probs = truncate(q, top_n or SV)
    seeds = torch.arange(N) * 1_000_003 + list(FIRST_TOKEN_CASES).index(case)  # fixed: no str hash()
    start = torch.arange(N) % 97
    draft = torch.stack([draw(q_ids.expand(N, -1), q_probs.expand(N, -1), seeds, start + j) for j in range(k)], 1)
    _, tokens = run(p.expand(N, k + 1, SV), draft, (q_ids.expand(N, k, -1), q_probs.expand(N, k, -1)),
                    seeds=seeds, start_pos=start)
    law = law_of(p)
    # Power: sampling the recovered token from p instead of norm(max(0, p - q)) would emit
    # min(p, q) + (1 - sum min(p, q)) p; with these p and q (overlap sum min(p, q) ~ 0.4-0.6) some
    # cell moves by > 0.03 against a standard error sqrt(p(1 - p) / 40k) <= 0.0025: > 5 sigma.
    qd = torch.zeros(SV, dtype=torch.float64).scatter_(0, q_ids, q_probs.double()).numpy()
    overlap = np.minimum(law, qd)
    assert_detectable(law, overlap + (1 - overlap.sum()) * law, N)
    assert_law(tokens[:, 0].numpy(), law)


def pair_law(p1, p_next, q1, q_next, k: int, recover=residual, bonus_from_slot0=False) -> np.ndarray:
    """The exact law of the first two emitted tokens [V, V] of a round with k in {1, 2} draft tokens.

    p1, q1 [V]: target and draft at the first position; p_next, q_next [V, V]: at the second, given
    the first token. A round that emits one token is followed by a K = 0 round sampling p_next.
    `recover` and `bonus_from_slot0` plant the bugs whose effect the tests must be able to see.
    """
    accept1 = np.minimum(p1, q1)  # P(draft x and accept x) = q(x) min(1, p(x)/q(x))
    law = (1 - accept1.sum()) * recover(p1, q1)[:, None] * p_next
    for x in range(len(p1)):
        if k == 1:
            law[x] += accept1[x] * (p1 if bonus_from_slot0 else p_next[x])
        else:
            accept2 = np.minimum(p_next[x], q_next[x])
            law[x] += accept1[x] * (accept2 + (1 - accept2.sum()) * recover(p_next[x], q_next[x]))
    return law


@pytest.mark.parametrize("k", [1, 2])
def test_two_token_sequences_follow_the_joint_target_law(k):
    v, n = 8, 50_000
    gen = torch.Generator().manual_seed(10 + k)
    # p(x2 | x1) peaks on a different token for every x1, so bonus or residual from the wrong slot shows
    cond_logits = torch.randn(v, v, generator=gen) + 3 * torch.eye(v).roll(1, 1)
    p1 = processed(TARGET[:v], temperature=0.8)
    p_next = processed(cond_logits, temperature=0.8, top_k=5)  # [V, V], rows: p(. | x1)
    q1 = processed(DRAFT_LOGITS[:v])
    q_next = processed(cond_logits.roll(2, 1) * 0.7)
    args = (law_of(p1), law_of(p_next), law_of(q1), law_of(q_next), k)
    joint = law_of(p1)[:, None] * law_of(p_next)
    np.testing.assert_allclose(pair_law(*args), joint, atol=1e-12)  # the algebra behind the rule, before the code
    # Power (5 sigma at n = 50k): sampling the recovered token from p, or (k = 1) the bonus from p1
    # instead of p(. | x1), moves some cell of the joint by > 5 standard errors sqrt(P(1 - P) / n).
    assert_detectable(joint.ravel(), pair_law(*args, recover=lambda p, q: p).ravel(), n)
    if k == 1:
        assert_detectable(joint.ravel(), pair_law(*args, bonus_from_slot0=True).ravel(), n)

    seeds = torch.arange(n) * 7_777_777 + k
    start = 11 + torch.arange(n) % 13
    x1 = draw(torch.arange(v).expand(n, v), q1.expand(n, v), seeds, start)
    drafts, qs, ps = [x1], [q1.expand(n, v)], [p1.expand(n, v), p_next[x1]]
    if k == 2:
        x2 = draw(torch.arange(v).expand(n, v), q_next[x1], seeds, start + 1)
        drafts.append(x2), qs.append(q_next[x1]), ps.append(p_next[x2])
    accepted, tokens = run(torch.stack(ps, 1), torch.stack(drafts, 1), torch.stack(qs, 1), seeds=seeds, start_pos=start)
    first, second = tokens[:, 0], tokens[:, 1].clone()
    # rows that emitted one token: the next round (K = 0, at the next position) samples p(. | first)
    one = accepted == 0
    _, nxt = run(p_next[first[one]].unsqueeze(1), torch.zeros(int(one.sum()), 0), torch.zeros(int(one.sum()), 0, v),
                 seeds=seeds[one], start_pos=start[one] + 1)
    second[one] = nxt[:, 0]
    assert 0.15 < float(one.float().mean()) < 0.85, "both paths (rejection at slot 0, acceptance) must be exercised"
    assert_law((first * v + second).numpy(), joint.ravel(), tv_bound=0.04)

    if k == 2:
        # the bonus after two acceptances follows p(. | x2), given x2
        full = accepted == 2
        x2_full, bonus = tokens[full, 1], tokens[full, 2]
        expected = law_of(p_next)[x2_full.numpy()].mean(0)  # the mixture over the rows' own x2
        pairs = (x2_full * v + bonus).numpy()
        cond = (np.bincount(x2_full.numpy(), minlength=v)[:, None] * law_of(p_next)).ravel()
        assert_law(pairs, cond / cond.sum(), tv_bound=0.05)
        assert_law(bonus.numpy(), expected, tv_bound=0.05)


def test_a_shifted_proposal_keeps_the_joint_target_law():
    """A round that ran as a plain step while the draft proposed from before it (the draft's first token
    drawn at the same position): when the step's token equals the draft's first, the draft's second
    token is verified next round; otherwise next round is a plain step. The first two tokens must
    follow p(x1) p(x2 | x1) exactly (app/speculation/driver.py, Proposal.after)."""
    v, n = 8, 50_000
    gen = torch.Generator().manual_seed(31)
    cond_logits = torch.randn(v, v, generator=gen) + 3 * torch.eye(v).roll(1, 1)
    p1, p_next = processed(TARGET[:v], temperature=0.8), processed(cond_logits, temperature=0.8, top_k=5)
    q1, q_next = processed(DRAFT_LOGITS[:v]), processed(cond_logits.roll(2, 1) * 0.7)
    seeds, start = torch.arange(n) * 5_555_557 + 3, 7 + torch.arange(n) % 11
    # round 1: a plain step at `start`; meanwhile the draft proposes two tokens from the same context
    _, step = run(p1.expand(n, 1, v), torch.zeros(n, 0), torch.zeros(n, 0, v), seeds=seeds, start_pos=start)
    first = step[:, 0]
    d1 = draw(torch.arange(v).expand(n, v), q1.expand(n, v), seeds, start)
    d2 = draw(torch.arange(v).expand(n, v), q_next[d1], seeds, start + 1)
    hit = d1 == first
    assert 0.05 < float(hit.float().mean()) < 0.95, "both paths (shifted proposal used or not) must be exercised"
    # round 2 at start + 1: the shifted proposal [d2] where it fits, a plain step elsewhere
    second = torch.empty(n, dtype=torch.long)
    _, verified = run(torch.stack([p_next[first[hit]], p_next[d2[hit]]], 1), d2[hit].unsqueeze(1),
                      q_next[first[hit]].unsqueeze(1), seeds=seeds[hit], start_pos=start[hit] + 1)
    second[hit] = verified[:, 0]
    _, plain = run(p_next[first[~hit]].unsqueeze(1), torch.zeros(int((~hit).sum()), 0),
                   torch.zeros(int((~hit).sum()), 0, v), seeds=seeds[~hit], start_pos=start[~hit] + 1)
    second[~hit] = plain[:, 0]
    joint = law_of(p1)[:, None] * law_of(p_next)
    # Power: taking the shifted draft token unverified (P(hit | x1) = q1(x1)) moves a cell > 5 sigma
    unverified = law_of(p1)[:, None] * (law_of(q1)[:, None] * law_of(q_next) + (1 - law_of(q1))[:, None] * law_of(p_next))
    assert_detectable(joint.ravel(), unverified.ravel(), n)
    assert_law((first * v + second).numpy(), joint.ravel(), tv_bound=0.04)


def test_a_top_p_below_float32s_smallest_number_keeps_the_most_likely_token():
    """5e-324 reads as 0 in float32: every token was cut, and the row sampled from NaN."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([5e-324]))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]
