"""The scheduler: what each forward of a model computes, and when.

Invariant. A model runs one forward at a time. Every item submitted while it runs (a verify round,
a draft proposal, a prompt chunk) goes into the next forward, up to `max_tokens` positions
(`target_batch.max_batch_tokens`), items left out last time first, then the cheapest: rounds
before prompt chunks. So:
- a forward never waits for a timer, and batches grow with the load (continuous batching at round
  granularity);
- a sequence with a round waiting is in the next forward unless that forward's budget is full, and
  then in the one after;
- no forward computes more positions than the budget the memory model sized its buffers for
  (app/model/memory.py), except a single item larger than it (a runner prefills such a context in
  chunks of `max_forward_tokens` first: `ModelRunner.prefill`).

What is submitted is decided elsewhere, and keeps the invariant useful:
- a prompt longer than `prefill_chunk` enters chunk by chunk, each chunk one item in one forward
  beside the other sequences' rounds (app/speculation/driver.py, `run_rounds`);
- a greedy or unseeded round with company never waits for its draft: it takes a plain step
  instead of holding its place (app/speculation/driver.py, "never wait with company").

Here: the queue (`ForwardQueue`) over app/coalesce.py's serial batcher, which applies the budget
and the order. The forward runs in a worker thread, so the event loop keeps streaming and calling
other pools.
"""

import asyncio
import collections
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from app import telemetry
from app.coalesce import MicroBatcher
from app.errors import is_fault, release_cached_memory

log = logging.getLogger(__name__)

Item, Result = TypeVar("Item"), TypeVar("Result")

ForwardFn = Callable[[list], Awaitable[list]]


def in_thread(fn: Callable[[list], list], executor=None) -> ForwardFn:
    """A blocking batch function run in a worker thread (torch releases the GIL while it computes):
    `executor`'s (a runner's own forward thread, ModelRunner.thread), else asyncio's default pool."""
    async def run(items: list) -> list:  # with the caller's context variables, as asyncio.to_thread
        ctx = contextvars.copy_context()  # (torch's dynamo settings live in them)
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(ctx.run, fn, items))
    return run


class LoadMeter:
    """What a queue's model did since the last read: how busy its forward loop was, how full its
    forwards were, how long items waited for one. The autoscaler's signals (deployments/autoscaling.py)
    are read from it once per metrics interval. `clock`: seconds, injected by tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._since, self._busy, self._forwards, self._items, self._tokens = now, 0.0, 0, 0, 0
        self._waited, self._waits = 0.0, 0

    def forward(self, seconds: float, items: int, tokens: int) -> None:
        self._busy += seconds
        self._forwards += 1
        self._items += items
        self._tokens += tokens

    def waited(self, seconds: float) -> None:
        """One item's wait for its forward (submitted to its forward's start)."""
        self._waited += max(0.0, seconds)
        self._waits += 1

    def read(self) -> dict[str, float]:
        """Since the last read: busy (fraction of the time a forward ran, 0-1), items_per_forward,
        tokens_per_forward, queue_wait_s (mean per item) and queue_forwards (that wait in forwards of
        the window's mean length: about 1 or less while every item makes the next forward, whatever
        the hardware); then starts a new window."""
        now = self.clock()
        span = max(now - self._since, 1e-9)
        forwards = max(self._forwards, 1)
        wait = self._waited / self._waits if self._waits else 0.0
        forward_s = self._busy / forwards
        out = {"busy": min(1.0, self._busy / span), "items_per_forward": self._items / forwards,
               "tokens_per_forward": self._tokens / forwards, "queue_wait_s": wait,
               "queue_forwards": wait / forward_s if forward_s > 0 else 0.0}
        self._reset(now)
        return out


@dataclass(frozen=True)
class BatchBudget:
    """What one fused forward may take: at most `max_items` items and `max_tokens` positions, `cost(item)`
    each (None: no bound). Rounds go before prompt chunks within it."""
    max_items: int | None = None
    max_tokens: int | None = None
    cost: Callable = lambda item: 1


class ForwardQueue(Generic[Item, Result]):
    """Serialises a model's forwards and fuses what waits; frees released sequences' caches safely.

    forward(items) -> one result per item (each result has a `stats` dict, filled here with the batch
    size, the forward's seconds and `extra_stats`); then on_batch(items, tokens, seconds). release(seq_id)
    frees a sequence's cache; a sequence released while a forward computing it runs has its cache freed
    again after it, since that forward stores it.

    One request never fails another: when a batch's forward raises, every sequence in it is
    forgotten (`forget(seq_id)`: its KV and grammar state, which the failed forward may have left half
    written; recomputed from the token ids each item carries) and the batch runs again in halves,
    down to single items, so the item that raised fails alone and the others get their results,
    as exactly as any forward gives them. A fault of the replica itself (app.errors.is_fault) fails
    the batch as it is.
    """

    def __init__(self, forward: ForwardFn, release: Callable[[str], Awaitable[None] | None], *, name: str,
                 budget: BatchBudget = BatchBudget(), extra_stats: dict | None = None,
                 on_batch: Callable[[int, int, float], None] = lambda size, tokens, seconds: None,
                 forget: Callable[[str], Awaitable[None] | None] | None = None):
        self.forward, self._release, self.name = forward, release, name
        self._forget = forget
        self.isolated = 0  # items that failed alone after their batch raised
        self.fault: str | None = None  # the replica's own failure, once one happened: it is unhealthy
        self.extra_stats = extra_stats or {}
        self.on_batch = on_batch
        self.served = 0  # items answered
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)
        self.load = LoadMeter()  # the autoscaler's view of this model's work
        self._cost = budget.cost
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._batcher = MicroBatcher(lambda items, _: self._run(items), budget.max_items, serial=True,
                                     max_cost=budget.max_tokens, cost=budget.cost)

    async def submit(self, item: Item) -> Result:
        t0 = self.load.clock()
        result = await self._batcher.submit(item)
        stats = getattr(result, "stats", None)
        if isinstance(stats, dict) and "forward_s" in stats:
            self.load.waited(self.load.clock() - t0 - stats["forward_s"])
        return result

    async def release(self, seq_id: str) -> None:
        """Free a finished or cancelled sequence's cache (ids are never reused)."""
        self._released[seq_id] = None
        if len(self._released) > 4096:
            self._released.popitem(last=False)
        await self._drop(seq_id)

    async def _drop(self, seq_id: str) -> None:
        await _maybe_await(self._release(seq_id))

    async def _run(self, items: list) -> list:
        stats = {"batch_size": len(items), **self.extra_stats}
        t0 = time.perf_counter()
        try:
            attrs = {"specserve.batch_size": len(items), **{f"specserve.{k}": v for k, v in self.extra_stats.items()}}
            with telemetry.batch_spans(self.name, [getattr(it, "trace", None) for it in items], attrs):
                try:
                    results = await self.forward(items)
                except Exception as e:
                    if is_fault(e):
                        self.fault = f"{type(e).__name__}: {e}"
                        raise
                    log.warning("%s: a batch of %d failed (%s: %s); running it again in parts", self.name,
                                len(items), type(e).__name__, e)
                    release_cached_memory(e)
                    results = await self._isolate(items, e)
        finally:
            for seq_id in {it.seq_id for it in items} & self._released.keys():
                await self._drop(seq_id)
        stats["forward_s"] = time.perf_counter() - t0
        tokens = sum(self._cost(it) for it in items)
        self.load.forward(stats["forward_s"], len(items), tokens)
        for r in results:
            if not isinstance(r, BaseException):
                r.stats.update(stats)
        self.served += len(items)
        self.batch_sizes.append(len(items))
        self.on_batch(len(items), tokens, stats["forward_s"])
        return results

    async def _isolate(self, items: list, error: Exception) -> list:
        """Results of a batch that raised `error`: forgotten, then run again in halves; an item that
        fails alone gets its exception as its result."""
        for seq_id in dict.fromkeys(it.seq_id for it in items):
            await _maybe_await(self._forget(seq_id) if self._forget else None)
        if len(items) == 1:
            self.isolated += 1
            return [error]
        mid = len(items) // 2
        results = []
        for part in (items[:mid], items[mid:]):
            try:
                results += await self.forward(part)
            except Exception as e:
                if is_fault(e):
                    self.fault = f"{type(e).__name__}: {e}"
                    raise
                release_cached_memory(e)
                results += await self._isolate(part, e)
        return results


async def _maybe_await(result) -> None:
    if asyncio.iscoroutine(result):
        await result
