"""A model's forward queue: the one batching layer of a server.

Every round that needs the model (a verify, a proposal) is submitted here; the queue runs one
forward at a time, in a worker thread so the event loop keeps streaming and calling other pools,
over everything that waited for it. Batches therefore grow with the load and never wait for a
timer: this is continuous batching at round granularity.
"""

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from app import telemetry
from app.batching import MicroBatcher

Item, Result = TypeVar("Item"), TypeVar("Result")

ForwardFn = Callable[[list], Awaitable[list]]


def in_thread(fn: Callable[[list], list]) -> ForwardFn:
    """A blocking batch function run in a worker thread (torch releases the GIL while it computes)."""
    async def run(items: list) -> list:
        return await asyncio.to_thread(fn, items)
    return run


class ForwardQueue(Generic[Item, Result]):
    """Serialises a model's forwards and fuses what waits; frees released sequences' caches safely.

    forward(items) -> one result per item (each result has a `stats` dict, filled here with the batch
    size, the forward's seconds and `extra_stats`). release(seq_id) frees a sequence's cache; a
    sequence released while a forward computing it runs has its cache freed again after it, since
    that forward stores it.
    """

    def __init__(self, forward: ForwardFn, release: Callable[[str], Awaitable[None] | None], *, name: str,
                 max_items: int | None = None, extra_stats: dict | None = None,
                 on_batch: Callable[[int], None] = lambda size: None,
                 max_tokens: int | None = None, cost: Callable[[Item], int] = lambda item: 1):
        self.forward, self._release, self.name = forward, release, name
        self.extra_stats = extra_stats or {}
        self.on_batch = on_batch
        self.served = 0  # items answered
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        # max_tokens: a forward's budget of positions (cost(item) each); rounds go before prompt chunks
        self._batcher = MicroBatcher(lambda items, _: self._run(items), max_items, serial=True,
                                     max_cost=max_tokens, cost=cost)

    async def submit(self, item: Item) -> Result:
        return await self._batcher.submit(item)

    async def release(self, seq_id: str) -> None:
        """Free a finished or cancelled sequence's cache (ids are never reused)."""
        self._released[seq_id] = None
        if len(self._released) > 4096:
            self._released.popitem(last=False)
        await self._drop(seq_id)

    async def _drop(self, seq_id: str) -> None:
        r = self._release(seq_id)
        if asyncio.iscoroutine(r):
            await r

    async def _run(self, items: list) -> list:
        stats = {"batch_size": len(items), **self.extra_stats}
        t0 = time.perf_counter()
        try:
            attrs = {"specserve.batch_size": len(items), **{f"specserve.{k}": v for k, v in self.extra_stats.items()}}
            with telemetry.batch_spans(self.name, [getattr(it, "trace", None) for it in items], attrs):
                results = await self.forward(items)
        finally:
            for seq_id in {it.seq_id for it in items} & self._released.keys():
                await self._drop(seq_id)
        stats["forward_s"] = time.perf_counter() - t0
        for r in results:
            if not isinstance(r, BaseException):
                r.stats.update(stats)
        self.served += len(items)
        self.batch_sizes.append(len(items))
        self.on_batch(len(items))
        return results
