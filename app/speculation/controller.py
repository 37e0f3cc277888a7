"""Choosing K: how many draft tokens a sequence speculates per round.

Terms (Leviathan et al., 2023):
    alpha        per-token probability that the target accepts a draft token
    c            cost ratio: one draft step / one target step (network hop included)
    verify_cost  V(K): extra target cost, relative to one step, of verifying K more tokens
                 per sequence; 0 while verifying K+1 tokens is as cheap as one step, grows
                 when batches stop being free (a busy target; on a CPU, a few rows). Measured
                 per K (VerifyCurve), or a slope v: V(K) = K·v
    overhead     w: the part of waiting for a proposal that does not grow with K (the call's hop,
                 its wait in the draft's queue), relative to one target round

A round drafts K tokens and emits 1 + (accepted) tokens, so its expected length is
sum_{i=0..K} alpha^i, and its cost, in target steps, is K*c + 1 + V(K), plus w when K > 0.
Counting w per step instead (c as wait / K) would make a slow hop look like an expensive draft
step, and the smaller K became the more expensive each step would look: K would spiral to 0
exactly where a longer K amortises the hop.

`CostEstimator` measures c online for one engine (a target replica); `KController` keeps one sequence's alpha
and picks the K that maximises the expected speed-up, falling back to K = 0 (plain target
steps) when speculation does not pay and probing now and then to notice when it does again.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from app.speculation.gate import GoodputGate

# what verifying K more tokens per sequence costs, in target steps: a slope v (K·v) or, measured,
# one figure per K (index K; app.speculation.controller.VerifyCurve.extra)
VerifyCost = float | Sequence[float]


def verify_extra(verify_cost: VerifyCost, k: int) -> float:
    """The extra target cost, in steps, of a round that verifies K draft tokens per sequence."""
    if isinstance(verify_cost, Sequence):
        return verify_cost[min(k, len(verify_cost) - 1)] if verify_cost else 0.0
    return k * verify_cost


def expected_accepted_length(alpha: float, k: int) -> float:
    """Expected tokens emitted per round, bonus included: (1 - α^(K+1)) / (1 - α)."""
    # Written as the geometric sum sum_{i=0..K} α^i: exact at α = 1 (→ K+1), no 0/0.
    alpha = min(max(alpha, 0.0), 1.0)
    return math.fsum(alpha**i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, c: float, verify_cost: VerifyCost = 0.0, overhead: float = 0.0) -> float:
    """Expected speed-up over plain decoding: (1 - α^(K+1)) / ((1 - α)(K·c + 1 + V(K) + w)), V(K) = K·v
    for a slope v."""
    if k == 0:
        return 1.0  # a plain target step: one token per step
    round_cost = k * c + 1.0 + verify_extra(verify_cost, k) + overhead  # in target steps
    return expected_accepted_length(alpha, k) / round_cost


def optimal_k(
    alpha: float, c: float, k_max: int, verify_cost: VerifyCost = 0.0, margin: float = 0.0, overhead: float = 0.0
) -> int:
    """The K in [0, k_max] maximising the expected speed-up; 0 unless some K beats 1 + margin."""
    speedups = [expected_speedup(alpha, k, c, verify_cost, overhead) for k in range(1, k_max + 1)]
    if not speedups:
        return 0
    best = max(range(len(speedups)), key=speedups.__getitem__)  # first of ties: smaller K
    return best + 1 if speedups[best] > 1.0 + margin else 0


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class CostConfig:
    """How the cost ratio c is measured."""

    prior_c: float = 0.1  # a draft ~10x cheaper than its target: typical pairing, speculates
    weight: float = 0.1  # EMA weight of the newest round: ~10 rounds of memory, smooths jitter
    c_min: float = 0.01  # timer noise on a tiny draft must not make drafting look free
    c_max: float = 1.0  # at c >= 1 no K > 0 can pay, so higher values change nothing


class VerifyCurve:
    """The target's forward time as a function of the tokens it computes, measured live.

    With B sequences in a forward, a round of K draft tokens each computes B·(K+1) tokens, so it costs
    V(K) = T(B·(K+1)) / T(B) - 1 steps more than a plain step. A GPU's T stays flat for hundreds of
    tokens; one CPU core's only while the weights' bytes, not the multiplies, bound the forward (the
    reference target on one core: flat to 5 rows, 1.45 steps at 9, 1.7 at 12). A token count never
    measured is read off its measured neighbours: between two, linearly; past the last, scaled by the
    roofline prior (flat to `saturation` tokens, then linear in them), which also stands in for T
    before any forward. Each round measures the K it chose, so a K that costs more than the prior
    said is seen the first time it runs.

    A point not measured for `max_age` forwards is forgotten: a K priced high once (a slowed forward)
    is never chosen, so never measured again; forgotten, it is read off its neighbours and the prior,
    tried when they say it pays, and measured anew.
    """

    def __init__(self, saturation: int, weight: float = 0.2, max_age: int = 2048):
        self.saturation = saturation
        self.weight = weight  # EMA weight of a forward's time at its token count
        self.max_age = max_age
        self._keys: list[int] = []  # measured token counts, sorted
        self._seconds: dict[int, float] = {}
        self._forwards = 0  # forwards observed
        self._at: dict[int, int] = {}  # token count -> the forward that last measured it

    @staticmethod
    def _key(tokens: int) -> int:
        """Exact to 64 tokens, then 16 points per doubling: forwards of 1000 and 1010 tokens cost alike."""
        if tokens <= 64:
            return tokens
        step = 1 << (tokens.bit_length() - 5)
        return tokens // step * step

    def _prior(self, tokens: float) -> float:
        return max(1.0, tokens / self.saturation)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one forward: the positions it computed and how long it took."""
        if tokens <= 0 or seconds <= 0:
            return
        key = self._key(tokens)
        if key not in self._seconds:
            bisect.insort(self._keys, key)
        self._seconds[key] = _ema(self._seconds.get(key), seconds, self.weight)
        self._forwards += 1
        self._at[key] = self._forwards
        for k in [k for k in self._keys if self._forwards - self._at[k] > self.max_age]:
            self._keys.remove(k)
            del self._seconds[k], self._at[k]

    def seconds(self, tokens: float) -> float | None:
        """T(tokens): measured, interpolated, or extrapolated by the prior; None before any forward."""
        keys = self._keys
        if not keys:
            return None
        if tokens > 64:
            tokens = self._key(int(tokens))
        i = bisect.bisect_left(keys, tokens)
        if i < len(keys) and keys[i] == tokens:
            return self._seconds[keys[i]]
        if i == len(keys):  # past the largest measured count
            last = keys[-1]
            return self._seconds[last] * self._prior(tokens) / self._prior(last)
        if i == 0:  # below the smallest
            first = keys[0]
            return self._seconds[first] * self._prior(tokens) / self._prior(first)
        lo, hi = keys[i - 1], keys[i]
        share = (tokens - lo) / (hi - lo)
        return (1 - share) * self._seconds[lo] + share * self._seconds[hi]

    def points(self) -> dict[int, float]:
        """The measured forward seconds by token count (replica stats)."""
        return {key: self._seconds[key] for key in self._keys}

    def extra(self, batch: float, k_max: int) -> list[float]:
        """V(K) for K = 0..k_max at B = `batch` sequences per forward: the controller's verify cost."""
        batch = max(batch, 1.0)
        base = self.seconds(batch)
        if base is None:
            base_prior = self._prior(batch)
            return [self._prior(batch * (k + 1)) / base_prior - 1.0 for k in range(k_max + 1)]
        return [max(0.0, self.seconds(batch * (k + 1)) / base - 1.0) for k in range(k_max + 1)]


class CostEstimator:
    """Online estimate of c = draft step time / target round time, and of the fixed part w of
    waiting for a proposal, shared by one engine; with the measured gate on speculating at all,
    where the engine has one (None: the cost model alone decides)."""

    def __init__(self, config: CostConfig | None = None, gate: GoodputGate | None = None) -> None:
        self.config = config or CostConfig()
        self.gate = gate
        self._draft_step_s: float | None = None  # EMA of one draft step's seconds
        self._draft_fixed_s: float | None = None  # EMA of the wait beyond the draft's forward: hop, queue
        self._target_round_s: float | None = None  # EMA of one verify round's seconds
        self._draft_latency_s: float | None = None  # EMA of a proposal's round trip, asked to answered
        self._accepted = self._rejected = 0.0  # decayed counts over every sequence's rounds

    def observe_acceptance(self, k: int, accepted: int) -> None:
        """Record a round's acceptance for the engine-wide alpha (the prior of new sequences)."""
        if k > 0:
            d = 1.0 - self.config.weight
            self._accepted = d * self._accepted + accepted
            self._rejected = d * self._rejected + (1.0 if accepted < k else 0.0)

    @property
    def alpha(self) -> float | None:
        """The acceptance rate of this engine's recent rounds (all sequences), None before any."""
        total = self._accepted + self._rejected
        return self._accepted / total if total >= 1.0 else None

    def observe(self, draft_seconds: float, draft_steps: int, target_seconds: float,
                draft_forward: tuple[float, int] | None = None) -> None:
        """Record one round: the wait for a proposal of `draft_steps` (= K) tokens and the target's
        time. `draft_forward`: (seconds, steps) of the draft forward that computed it, as its replica
        reported; with it the wait splits into steps and a fixed part (only what was waited for
        counts: a proposal drafted ahead costs what was left of it)."""
        w = self.config.weight
        if draft_steps > 0 and draft_seconds > 0:
            if draft_forward is not None and draft_forward[1] > 0 and draft_forward[0] > 0:
                forward_s, steps = draft_forward
                step = forward_s / steps
                waited_steps = min(draft_seconds, step * draft_steps)
                self._draft_step_s = _ema(self._draft_step_s, waited_steps / draft_steps, w)
                self._draft_fixed_s = _ema(self._draft_fixed_s, draft_seconds - waited_steps, w)
            else:
                self._draft_step_s = _ema(self._draft_step_s, draft_seconds / draft_steps, w)
        if target_seconds > 0:
            self._target_round_s = _ema(self._target_round_s, target_seconds, w)

    @property
    def overhead(self) -> float:
        """w: the fixed part of waiting for a proposal, in target rounds (0 until measured)."""
        if self._draft_fixed_s is None or not self._target_round_s:
            return 0.0
        return min(self._draft_fixed_s / self._target_round_s, self.config.c_max * 8)

    def observe_latency(self, seconds: float) -> None:
        """Record how long one proposal took from request to answer (drafted ahead or not)."""
        self._draft_latency_s = _ema(self._draft_latency_s, seconds, self.config.weight)

    @property
    def draft_keeps_up(self) -> bool:
        """Whether a proposal asked for now is usually in hand before a verify round ends."""
        return (self._draft_latency_s is not None and self._target_round_s is not None
                and self._draft_latency_s < self._target_round_s)

    @property
    def c(self) -> float:
        """Current cost ratio; the prior until both sides have been measured."""
        cfg = self.config
        if self._draft_step_s is None or self._target_round_s is None:
            return cfg.prior_c
        return min(max(self._draft_step_s / self._target_round_s, cfg.c_min), cfg.c_max)


@dataclass
class KControllerConfig:
    """How a sequence's K is chosen; shared by all sequences of an engine."""

    k_max: int = 8  # longer runs rarely survive; also bounds the wasted draft work per round
    prior_alpha: float = 0.6  # draft/target pairs usually agree this often: start speculating
    prior_weight: float = 2.0  # ...but only as strong as two observed tokens, so data wins fast
    # per observed round, ~5 rounds of memory: notices a change in the text within ~15 rounds
    # and costs under 2% of the ideal speed-up on a steady stream
    decay: float = 0.8
    margin: float = 0.05  # speculate only when it clearly pays: estimates of α and c are noisy
    probe_interval: int = 16  # after this many K = 0 rounds, try speculation again once
    probe_k: int = 2  # a probe is cheap: 2 draft steps, enough to see a run of acceptances
    probe_memory: float = 2.0  # old evidence kept at a probe, in tokens: one good probe re-enables
    # a sequence keeps speculating while K > 0 would pay at alpha this many standard errors above its
    # estimate (KController.choose says why)
    confidence: float = 1.0

    def __post_init__(self) -> None:
        if self.k_max < 0 or self.probe_k < 1 or self.probe_interval < 1:
            raise ValueError("k_max must be >= 0, probe_k and probe_interval >= 1")
        if not (0.0 < self.decay <= 1.0 and 0.0 <= self.prior_alpha <= 1.0):
            raise ValueError("decay must be in (0, 1] and prior_alpha in [0, 1]")
        if not self.confidence >= 0.0:  # NaN too
            raise ValueError(f"confidence must be >= 0 standard errors, got {self.confidence}")


class KController:
    """Per-sequence acceptance estimate and choice of K.

    Each drafted token is a Bernoulli trial, and the draft stops at the first rejection: a
    round with K drafted and A accepted shows A successes and one failure if A < K (none if
    all were accepted). The maximum-likelihood α is successes / (successes + failures);
    averaging A/K instead is biased low, because a run is cut short by its first rejection.
    Counts decay each round so that α follows the text.
    """

    def __init__(self, config: KControllerConfig | None = None, pinned_k: int | None = None,
                 prior_alpha: float | None = None):
        """prior_alpha: what a new sequence starts from (the engine's recent acceptance), instead of the
        config's fixed prior; a prior that underestimates the pair would keep K at 0 where the wait for
        a proposal is long, and a sequence that never drafts never learns better."""
        self.config = config or KControllerConfig()
        if pinned_k is not None and pinned_k < 0:
            raise ValueError(f"pinned K must be >= 0 (0 turns speculation off), got {pinned_k}")
        self.pinned_k = pinned_k
        cfg = self.config
        prior = cfg.prior_alpha if prior_alpha is None else min(max(prior_alpha, 0.0), 1.0)
        self._successes = prior * cfg.prior_weight  # decayed accepted tokens
        self._failures = (1.0 - prior) * cfg.prior_weight  # decayed rejections
        self._zero_rounds = 0  # consecutive rounds choose() returned 0

    def snapshot(self) -> tuple[float, float, int]:
        """The state that decides future K: streamed with the tokens, so a request resumed on another
        replica chooses the same K schedule (a seeded request's draws depend on it)."""
        return (self._successes, self._failures, self._zero_rounds)

    def restore(self, snapshot: tuple[float, float, int] | list | None) -> "KController":
        if snapshot is not None:
            self._successes, self._failures, self._zero_rounds = float(snapshot[0]), float(snapshot[1]), int(snapshot[2])
        return self

    @property
    def alpha(self) -> float:
        """Current estimate of the per-token acceptance rate."""
        total = self._successes + self._failures
        return self._successes / total if total > 0 else self.config.prior_alpha

    @property
    def upper_alpha(self) -> float:
        """The estimate `confidence` standard errors up: sqrt(alpha (1 - alpha) / trials) over the decayed
        trials, the variance floored at 0.01 so that an estimate of 0 or 1 still has a band."""
        trials = self._successes + self._failures
        alpha = self.alpha
        spread = math.sqrt(max(alpha * (1.0 - alpha), 0.01) / max(trials, 1.0))
        return min(1.0, alpha + self.config.confidence * spread)

    def observe(self, k: int, accepted: int) -> None:
        """Record a round that drafted `k` tokens of which the target accepted `accepted`."""
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must be in [0, k]; got accepted={accepted}, k={k}")
        if k == 0:
            return  # a plain step says nothing about α; keep what we know
        d = self.config.decay
        self._successes = d * self._successes + accepted
        self._failures = d * self._failures + (1.0 if accepted < k else 0.0)

    def choose(self, c: float, verify_cost: VerifyCost = 0.0, overhead: float = 0.0) -> int:
        """K for the next round: the speed-up maximiser, 0 when none pays, now and then a probe."""
        if self.pinned_k is not None:
            return self.pinned_k
        cfg = self.config
        k = optimal_k(self.alpha, c, cfg.k_max, verify_cost, cfg.margin, overhead)
        if k == 0 and cfg.k_max > 0:
            # Why the optimistic alpha: the estimate holds ~5 rounds (decay), ~10 trials, so it wanders
            # +-0.15 around a pair's true acceptance, and a dip below the break-even held the sequence
            # to plain steps until a probe (16 rounds) found better. On the reference pair at C1 (tau
            # ~2 at K = 4, the draft ahead) auto K then took 59-65 % of its rounds plain, and ran 5 %
            # behind K pinned at 4 through Serve (8 % in a replay of the held-out prompts' acceptance,
            # where one standard error closed the gap: 45.3 -> 48.9 tok/s against 49.0). A draft that
            # is truly poor stays plain: its estimate is low with a narrow band (replayed with the
            # draft's tokens scrambled: plain 95 % of rounds either way).
            k = optimal_k(self.upper_alpha, c, cfg.k_max, verify_cost, cfg.margin, overhead)
        if k > 0 or cfg.k_max == 0:
            self._zero_rounds = 0
            return k
        hopeful = max(self.alpha, cfg.prior_alpha)  # what a probe could find the acceptance to be
        if (optimal_k(hopeful, c, cfg.k_max, verify_cost, cfg.margin, overhead) == 0
                and optimal_k(self.alpha, c, cfg.k_max, 0.0, cfg.margin, overhead) > 0):
            # the busy target, not the draft, makes speculation not pay, even were acceptance as good as
            # a probe could find it; the load is measured live (K returns the round it drops), so a probe
            # would only add rows and a draft call to forwards that are already the bottleneck
            self._zero_rounds = 0
            return 0
        self._zero_rounds += 1
        if self._zero_rounds < cfg.probe_interval:
            return 0
        self._zero_rounds = 0
        self._forget(cfg.probe_memory)
        return min(cfg.probe_k, cfg.k_max)

    def _forget(self, keep: float) -> None:
        """Shrink the evidence to at most `keep` tokens, same α, so a probe's result counts."""
        total = self._successes + self._failures
        if total > keep:
            scale = keep / total
            self._successes *= scale
            self._failures *= scale
