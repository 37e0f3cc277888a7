"""Sampling and the rejection sampler of speculative decoding.

Terms (per sequence b with K_b draft tokens):
- accepted tokens: the longest prefix of the draft that passes the test u * q(x) < p(x);
- recovered token: on the first rejection, a sample of norm(max(0, p - q)) at that position;
- bonus token: when all K_b are accepted, a sample of p at position K_b + 1.
A round therefore emits accepted + 1 tokens. p is the *processed* target distribution
(temperature, top-k, top-p applied); greedy rows use a one-hot p and q.

Randomness is addressable: every uniform is a hash of (seed, absolute position, purpose), so a
seeded sequence draws the same numbers whatever batch, replica or retry it runs in.
"""

from dataclasses import dataclass

import torch

# Purposes of a random draw, so draws at one position never collide.
DRAFT, ACCEPT, EMIT = 1, 2, 3

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijective avalanche of 64 bits (int64 arithmetic wraps)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """U[0, 1) draws addressed by (seed, position, purpose). seeds, positions: [N] int64 -> [N] float64."""
    h = _mix(_mix(seeds.long()) ^ positions.long())
    h = _mix(h ^ purpose)
    return _shr(h, 11).double() / float(1 << 53)


@dataclass(frozen=True)
class SamplingSteps:
    """Which steps of process_logits some row of a batch needs (a step no row needs is skipped)."""

    min_p: bool = True
    truncate: bool = True  # top-k or top-p
    greedy: bool = True

    @classmethod
    def of(cls, params, vocab_size: int) -> "SamplingSteps":
        """From the requests' sampling parameters (objects with temperature, top_k, top_p, min_p), on the host."""
        return cls(min_p=any(p.min_p > 0 for p in params),
                   truncate=any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params),
                   greedy=any(p.temperature <= 0 for p in params))


def process_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]; 0 = greedy
    top_k: torch.Tensor,  # [N] int; <= 0 keeps all
    top_p: torch.Tensor,  # [N]; 1 keeps all
    min_p: torch.Tensor | None = None,  # [N]; 0 keeps all
    *,
    steps: "SamplingSteps | None" = None,
) -> torch.Tensor:
    """The distribution each row samples from: [N, V] float32 probabilities (one-hot for greedy rows).
    After temperature, min_p and then top-k and top-p truncate (vLLM's order).

    `steps`: which of those steps any row needs, as the caller knows from its requests' parameters on
    the host; without it they are read from the tensors, a device-to-host sync each."""
    logits = logits.float()
    n, v = logits.shape
    greedy = temperature <= 0
    if steps is None:
        steps = SamplingSteps(min_p=min_p is not None and bool((min_p > 0).any()),
                              truncate=bool((((top_k > 0) & (top_k < v)) | (top_p < 1.0)).any()),
                              greedy=bool(greedy.any()))
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    if min_p is not None and steps.min_p:
        # a token stays when its probability is at least min_p times the top one's: in logits,
        # when it is at most log(1 / min_p) below the top logit
        floor = scaled.max(-1, keepdim=True).values + torch.log(min_p.clamp(min=1e-30)).unsqueeze(-1)
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0).unsqueeze(-1), float("-inf"))
    if steps.truncate:
        scaled = _truncate(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if steps.greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), onehot, probs)
    return probs


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p remove. scaled: [N, V]."""
    v = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=v), v).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # keep a token while the mass before it is < top_p: the smallest set reaching top_p
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # rows with top_p = 1 keep everything: float32 mass can reach 1.0 before the tail ends; the most
    # likely token always stays (a top_p below float32's smallest number reads as 0, which cut it too)
    cut = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(-1, order, sorted_logits)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, M] (unnormalised is fine), u [N] in [0, 1) -> [N] column index."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    # right=True skips zero-probability columns even when target is exactly 0
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] processed p at each draft position and the bonus one
    draft_tokens: torch.Tensor,  # [B, K] int64, padded past num_draft
    q_ids: torch.Tensor,  # [B, K, M] int64: support of the draft's distribution q (sparse)
    q_probs: torch.Tensor,  # [B, K, M] q on that support (0 for padding)
    num_draft: torch.Tensor,  # [B] int64, K_b in [0, K]
    greedy: torch.Tensor,  # [B] bool
    seeds: torch.Tensor,  # [B] int64
    start_pos: torch.Tensor,  # [B] int64: absolute position of draft slot 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative acceptance over a ragged batch.

    Returns (accepted [B], tokens [B, K+1]): row b emits tokens[b, :accepted[b] + 1]; the rest is -1.
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    slots = torch.arange(k, device=device)
    valid = slots.unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    positions = start_pos.unsqueeze(1) + torch.arange(k1, device=device)  # [B, K+1]

    p_at_draft = target_probs[:, :k].gather(-1, draft_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, K]
    q_at_draft = (q_probs * (q_ids == draft_tokens.unsqueeze(-1))).sum(-1)  # [B, K]
    u = uniform(seeds.repeat_interleave(k), positions[:, :k].reshape(-1), ACCEPT).view(b, k)
    # accept with probability min(1, p/q); q = 0 accepts iff p > 0 (the ratio is infinite)
    accept = u * q_at_draft.double() < p_at_draft.double()
    target_argmax = target_probs[:, :k].argmax(-1)
    accept = torch.where(greedy.unsqueeze(1), draft_tokens == target_argmax, accept) & valid
    accepted = accept.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix

    last = accepted.view(b, 1, 1)
    p_last = target_probs.gather(1, last.expand(b, 1, v)).squeeze(1)  # [B, V]
    rejected = accepted < num_draft  # rows that emit a recovered token, not a bonus one
    residual = p_last.clone()
    if k > 0:
        j = accepted.clamp(max=k - 1).view(b, 1, 1)
        m = q_ids.shape[-1]
        q_last_ids = q_ids.gather(1, j.expand(b, 1, m)).squeeze(1)
        q_last = q_probs.gather(1, j.expand(b, 1, m)).squeeze(1) * rejected.unsqueeze(-1)
        residual.scatter_add_(-1, q_last_ids, -q_last.to(residual.dtype))
        residual.clamp_(min=0)
    # p <= q everywhere (only possible when p == q up to rounding): the residual is empty, sample p
    empty = residual.sum(-1) <= 1e-12
    residual = torch.where(empty.unsqueeze(-1), p_last, residual)
    u_emit = uniform(seeds, positions.gather(1, accepted.unsqueeze(1)).squeeze(1), EMIT)
    emitted = torch.where(greedy, p_last.argmax(-1), sample(residual, u_emit))

    tokens = torch.full((b, k1), -1, dtype=torch.long, device=device)
    in_prefix = slots.unsqueeze(0) < accepted.unsqueeze(1)  # [B, K]
    tokens[:, :k] = torch.where(in_prefix, draft_tokens, -1)
    tokens.scatter_(1, accepted.unsqueeze(1), emitted.unsqueeze(1))
    return accepted, tokens
