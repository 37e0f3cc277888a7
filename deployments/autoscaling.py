"""Each pool scales on what limits it, through Ray Serve's custom autoscaling policies.

Serve's default signal, ongoing requests per replica, does not fit the data path: a target replica
asks the draft pool once per step for all its sequences, so a draft replica's ongoing requests are
about the number of target replicas whatever the load, and a target replica is bounded by its KV
blocks, its forward's token budget and its queue rather than by a request count. So every replica
reports its own load (`record_autoscaling_stats`, read by Serve once per `metrics_interval_s` and
averaged over `look_back_period_s`), and a policy per pool turns those figures into a replica count.

- A draft replica reports how busy its forward loop was (`busy`, the share of the time a forward
  ran), the sequences it drafted for per forward, its proposals' wait for a forward in forwards
  (`queue_forwards`), and `wait_share`: the share of their rounds' time its callers (target
  replicas) spent waiting for proposals, which each call carries.
- A target replica reports the KV its live sequences hold against its budget (`kv`; retired prefix
  donors, evicted for free, do not count: counting them, a draft-bound ramp filled the pool with
  donors and grew the target pool), its forwards' fill of the token budget (`fill`), items' wait for
  a forward in seconds and in forwards (`queue_wait_s`, `queue_forwards`: about 1 or less while
  every round makes the next forward, whatever the hardware), the time its requests' first rounds
  took (`ttft_s`: the prompt's prefill, queue included) and its own `busy`.

The policies return the replicas they want; Serve's wrapper applies the deployment's
`min_replicas` / `max_replicas`, `upscale_delay_s` / `downscale_delay_s` (a want must last that
long) and scaling factors. Hysteresis is the gap between each signal's up and down thresholds:
between them the pool holds.
"""

import math
from dataclasses import dataclass

class RoundLoad:
    """A target replica's rounds since the last read (an app.telemetry.RoundObserver): the share of
    their time spent waiting for proposals, and how long first rounds took."""

    def __init__(self):
        self._round_s = self._wait_s = self._first_s = 0.0
        self._firsts = 0
        self.wait_share = 0.0  # smoothed over reads: what this replica tells the draft pool with each call

    def round(self, f) -> None:  # f: app.telemetry.RoundFacts (not imported: Serve's controller loads this module)
        self._round_s += f.round_s
        if f.prompt:
            self._first_s += f.round_s
            self._firsts += 1
        elif f.drafted and not f.ahead_hit:
            self._wait_s += f.draft_s  # a proposal drafted ahead and used cost the round no wait

    def read(self) -> dict[str, float]:
        share = self._wait_s / self._round_s if self._round_s > 0 else 0.0
        self.wait_share = 0.5 * self.wait_share + 0.5 * share
        out = {"wait_share": share, "ttft_s": self._first_s / self._firsts if self._firsts else 0.0}
        self._round_s = self._wait_s = self._first_s = 0.0
        self._firsts = 0
        return out


class Observers:
    """Tells every one of several round observers."""

    def __init__(self, *observers):
        self.observers = observers

    def round(self, facts) -> None:
        for o in self.observers:
            o.round(facts)


class CallerWaits:
    """What a draft replica's callers said about their wait for proposals, averaged per window."""

    def __init__(self):
        self._sum, self._n = 0.0, 0

    def add(self, share: float | None) -> None:
        if share is not None and math.isfinite(share):
            self._sum += min(max(share, 0.0), 1.0)
            self._n += 1

    def read(self) -> float:
        out = self._sum / self._n if self._n else 0.0
        self._sum, self._n = 0.0, 0
        return out


def _values(metrics: dict | None, name: str) -> list[float]:
    """The per-replica (already time-averaged) values of one signal; replicas that sent none are left out."""
    return [float(v) for v in ((metrics or {}).get(name) or {}).values() if v is not None and math.isfinite(v)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class DraftPoolPolicy:
    """The draft pool grows when its forward loops are busy, or when its callers wait for proposals
    that queue at the draft (each waits for other sequences' forwards: more replicas shorten that;
    a wait that is the draft's own steps, which no replica count shortens, does not grow it). It
    shrinks when its loops are idle and nothing queues. Up: the replicas that would bring mean busy
    back to `busy_target` (at least one more). Down: one fewer."""

    busy_up: float = 0.8  # mean busy fraction above which the pool grows
    busy_down: float = 0.3  # and below which (nothing queueing) it may shrink
    busy_target: float = 0.6
    wait_up: float = 0.2  # share of the callers' round time spent waiting for proposals
    queue_up: float = 1.0  # a proposal's mean wait for a draft forward, in forwards
    queue_down: float = 0.25

    def desired(self, current: int, metrics: dict | None) -> int:
        busy, wait, queue = _values(metrics, "busy"), _values(metrics, "wait_share"), _values(metrics, "queue_forwards")
        if not busy or current < 1:
            return current  # no figures yet (replicas starting): hold
        mean_busy, mean_wait, mean_queue = _mean(busy), _mean(wait), _mean(queue)
        if mean_busy > self.busy_up or (mean_wait > self.wait_up and mean_queue > self.queue_up):
            return max(current + 1, math.ceil(sum(busy) / self.busy_target))
        if mean_busy < self.busy_down and mean_queue < self.queue_down and current > 1:
            return current - 1
        return current

    def __call__(self, ctx) -> tuple[int, dict]:
        return self.desired(ctx.current_num_replicas, ctx.aggregated_metrics), {}


@dataclass
class TargetPoolPolicy:
    """The target pool grows on KV pressure, a queue for its forwards, first rounds past the goal or
    a saturated forward loop; it shrinks when every one of them is well below. One replica at a
    time: a target replica is a large load, and a new one takes minutes to hold its share."""

    kv_up: float = 0.85  # live sequences' KV (of the replica's budget)
    kv_down: float = 0.4
    queue_up: float = 2.0  # an item's mean wait for a forward, in forwards
    queue_down: float = 0.5
    ttft_goal_s: float = 2.0  # the first round's time (prefill, queue included)
    busy_up: float = 0.95
    busy_down: float = 0.5

    def desired(self, current: int, metrics: dict | None) -> int:
        kv, queue = _values(metrics, "kv"), _values(metrics, "queue_forwards")
        ttft, busy = _values(metrics, "ttft_s"), _values(metrics, "busy")
        if not (kv or queue or ttft or busy) or current < 1:
            return current
        hot = (_mean(kv) > self.kv_up or _mean(queue) > self.queue_up or max(ttft, default=0.0) > self.ttft_goal_s
               or _mean(busy) > self.busy_up)
        if hot:
            return current + 1
        cold = (_mean(kv) < self.kv_down and _mean(queue) < self.queue_down
                and max(ttft, default=0.0) < 0.5 * self.ttft_goal_s and _mean(busy) < self.busy_down)
        return current - 1 if cold and current > 1 else current

    def __call__(self, ctx) -> tuple[int, dict]:
        return self.desired(ctx.current_num_replicas, ctx.aggregated_metrics), {}
