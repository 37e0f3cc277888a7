"""The goodput gate: whether speculating emits more tokens per second than plain steps, measured
at the engine's current load; the driver holds flexible sequences with company to plain steps where
it does not (app/speculation/driver.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def load_bucket(active: float) -> int:
    """Sequences in flight, as a power-of-two bucket: 1, 2-3, 4-7, 8-15, ..."""
    return max(0, int(math.log2(max(active, 1.0))))


@dataclass
class GoodputGate:
    """Whether speculation pays on this engine at its current load, measured, not modelled.

    The cost model above assumes the draft computes beside the target. Where both share the
    machine's cores (a CPU node, a small test cluster), drafting takes compute from the target's
    forwards, and at high load speculation can emit fewer tokens per second than plain steps
    although every round looks worth it: one sequence's drafting slows the rounds of the others
    that share its forwards, which no sequence's own controller sees. So where two or more
    sequences are in flight, time is cut into windows; in each one every flexible sequence either
    may speculate or takes plain steps. The engine's emitted tokens per second are kept per mode
    and per load bucket (sequences in flight). The faster mode is used, and the other is tried
    again after `explore` windows, so a change in load or text is noticed; the further behind it
    measured, the longer it waits (up to `explore_max` windows: `margin` of the rate per `explore`),
    since each try costs that gap for a window. At 16 sequences on a 2-core CPU plain steps measure
    10-15 % faster, and trying speculation one window in five cost a fifth of that.

    A sequence alone is not gated (the driver asks only with company): its own rounds carry every
    cost it pays, the wait for its proposal and its verifies slowed by the draft beside them, and
    its K controller weighs them round by round.

    A window closes after `window_s` and at least `min_rounds` rounds: a rate over a few rounds
    follows the text (a run of easy tokens), not the mode. A mode's windows at one load are pooled,
    tokens over seconds, the older ones weighing `memory` per newer window. A window broken by an
    idle gap (no round for `window_s`) or by a round alone measures nothing.

    Only K that output does not depend on is gated: greedy and unseeded requests, K not pinned.
    A seeded sampled request's K depends on its own history alone (app/speculation/driver.py).
    """

    clock: Callable[[], float] = time.monotonic
    window_s: float = 0.5  # short enough to follow the load
    min_rounds: int = 16  # ...and enough rounds that the text's easy and hard runs average out
    explore: int = 5  # the mode that measured slower is tried again after this many windows...
    explore_max: int = 20  # ...or up to this many, the further behind it measured
    margin: float = 0.05  # a gap of this share of the slower mode's rate waits `explore` windows, twice it twice as long
    memory: float = 0.5  # weight of a mode's earlier windows at a load against its newest
    pooled: dict = field(default_factory=dict)  # (speculating, load bucket) -> [tokens, seconds], decayed
    speculating: bool = True
    _start: float | None = None  # None: no window open
    _last: float = 0.0  # the last round's end
    _tokens: int = 0
    _load: float = 0.0  # sum over the window's rounds of sequences in flight
    _rounds: int = 0
    _since_explore: int = 0

    @property
    def rates(self) -> dict:
        """(speculating, load bucket) -> tokens per second, as measured so far."""
        return {key: tokens / seconds for key, (tokens, seconds) in self.pooled.items()}

    def allows(self) -> bool:
        """Whether a flexible sequence with company may draft in the window now running."""
        return self.speculating

    def emitted(self, tokens: int, active: int) -> None:
        """Record a round's emitted tokens and the sequences in flight as it ended."""
        now = self.clock()
        idle = now - self._last > self.window_s
        self._last = now
        if active < 2 or idle or self._start is None:  # this round opens the next window
            self._start, self._tokens, self._load, self._rounds = (now if active >= 2 else None), 0, 0.0, 0
            return
        self._tokens += tokens
        self._load += active
        self._rounds += 1
        elapsed = now - self._start
        if elapsed < self.window_s or self._rounds < self.min_rounds:
            return
        key = (self.speculating, load_bucket(self._load / self._rounds))
        old_tokens, old_seconds = self.pooled.get(key, (0.0, 0.0))
        self.pooled[key] = [self.memory * old_tokens + self._tokens, self.memory * old_seconds + elapsed]
        self.speculating = self._next(key[1])
        self._start, self._tokens, self._load, self._rounds = now, 0, 0.0, 0

    def _next(self, bucket: int) -> bool:
        rates = self.rates
        spec, plain = rates.get((True, bucket)), rates.get((False, bucket))
        if spec is None and self._plain_won_below(bucket):
            # plain steps measured faster at a lower load: speculation only loses ground as the load grows
            # (the verify's rows and the draft's work grow with it), so at this load it is tried after the
            # longest wait rather than first. Each load a burst passes through (2, 4, 8, 16 in flight) once
            # cost a speculative window where plain steps had already won.
            self._since_explore += 1
            if self._since_explore >= self.explore_max:
                self._since_explore = 0
                return True
            return False
        if spec is None or plain is None:  # measure the mode not yet seen at this load
            self._since_explore = 0
            return spec is None
        best = spec >= plain
        self._since_explore += 1
        if self._since_explore >= self._interval(max(spec, plain) / max(min(spec, plain), 1e-9) - 1):
            self._since_explore = 0
            return not best
        return best

    def _plain_won_below(self, bucket: int) -> bool:
        """Whether plain steps measured faster at the nearest lower load where both modes were measured."""
        rates = self.rates
        both = [b for (speculating, b) in rates if speculating and b < bucket and (False, b) in rates]
        return bool(both) and rates[(False, max(both))] > rates[(True, max(both))]

    def _interval(self, gap: float) -> int:
        """Windows before the slower mode is tried again, for a gap (its share of the slower rate)."""
        return min(self.explore_max, max(self.explore, round(self.explore * gap / self.margin)))
