"""Coalescing of concurrent rounds: calls made in the same event-loop turn go out as one batch.

Every deployment call costs milliseconds of Ray and Serve bookkeeping, so a target replica
coalesces its sequences' proposals into one call to the draft pool per turn (Serve has no
client-side batching); with serial=True the same batcher is each server's forward queue
(app/scheduler.py).
"""

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

Item, Result = TypeVar("Item"), TypeVar("Result")

BatchFn = Callable[[list[Item], Hashable], "list[Result | BaseException] | Awaitable[list[Result | BaseException]]"]


class MicroBatcher(Generic[Item, Result]):
    """Collects `submit` calls until the loop has run every ready coroutine, then calls fn once per key.

    fn(items, key) returns one result per item, or an awaitable of them; a result that is an
    exception fails that item alone, an exception raised by fn fails the whole batch. A caller
    that stops waiting (cancelled, past a deadline) is left out of a batch not yet sent, and a sent
    call whose callers all stopped waiting is cancelled (so a call to a dead or stuck replica does
    not linger).

    serial=True: one batch in flight at a time (one model); what arrives meanwhile waits and goes
    as the next batch the moment the model is free, so batches grow with the load.
    """

    def __init__(self, fn: BatchFn, max_items: int | None = None, serial: bool = False,
                 max_cost: int | None = None, cost: Callable[[Item], int] = lambda item: 1):
        self.fn = fn
        self.max_items = max_items
        self.serial = serial
        # serial only: a batch holds items of total cost <= max_cost (always at least one), the
        # cheapest first in arrival order, so a few expensive items never hold back many cheap ones;
        # an item left out once goes first next time, so a stream of cheap items cannot starve it
        self.max_cost, self.cost = max_cost, cost
        self._deferred: set[asyncio.Future] = set()
        self.pending: dict[Hashable, list[tuple[Item, asyncio.Future]]] = {}
        self.batch_sizes: list[int] = []
        self._in_flight: set[asyncio.Task] = set()

    async def submit(self, item: Item, key: Hashable = None) -> Result:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        group = self.pending.setdefault(key, [])
        group.append((item, future))
        if len(group) == 1 and not (self.serial and self._in_flight):
            # call_soon runs after the coroutines already woken this turn have submitted theirs
            loop.call_soon(self._flush, key)
        return await future

    def _flush(self, key: Hashable) -> None:
        if self.serial and self._in_flight:
            return  # the batch in flight flushes again when it is done
        waiting = [(item, f) for item, f in self.pending.pop(key, []) if not f.done()]
        if self.serial and self.max_cost:
            waiting = self._within_budget(key, waiting)
        size = self.max_items or len(waiting) or 1
        if self.serial and len(waiting) > size:  # the rest waits its turn
            self.pending[key] = waiting[size:] + self.pending.get(key, [])
            waiting = waiting[:size]
        for start in range(0, len(waiting), size):
            chunk = waiting[start : start + size]
            self.batch_sizes.append(len(chunk))
            try:
                results = self.fn([item for item, _ in chunk], key)
            except Exception as e:  # one bad batch fails its callers, not the loop
                _settle(chunk, e)
                continue
            if inspect.isawaitable(results):
                # a call whose callers all left is cancelled, unless serial: a model's forward runs to its end
                task = asyncio.ensure_future(_settle_later(chunk, results, cancel_abandoned=not self.serial))
                self._in_flight.add(task)
                task.add_done_callback(self._done)
            else:
                _settle(chunk, results)

    def _within_budget(self, key: Hashable, waiting: list) -> list:
        """The items this batch takes under max_cost; the others go back to wait for the next one."""
        costs = [self.cost(item) for item, _ in waiting]
        # stable: arrival order among equals
        order = sorted(range(len(waiting)), key=lambda i: (waiting[i][1] not in self._deferred, costs[i]))
        taken, total = set(), 0
        for i in order:
            if taken and total + costs[i] > self.max_cost:
                break
            taken.add(i)
            total += costs[i]
        left = [w for i, w in enumerate(waiting) if i not in taken]
        self._deferred = {f for _, f in left}
        if left:
            self.pending[key] = left + self.pending.get(key, [])
        return [w for i, w in enumerate(waiting) if i in taken]

    def _done(self, task: asyncio.Task) -> None:
        self._in_flight.discard(task)
        if self.serial:
            for key in list(self.pending):
                self._flush(key)


async def _settle_later(chunk: list, results: Awaitable, cancel_abandoned: bool) -> None:
    call = asyncio.ensure_future(results)
    abandoned = False

    def check(_) -> None:  # every caller gave up (deadline, disconnect): cancel the call itself
        nonlocal abandoned
        if not call.done() and all(f.done() for _, f in chunk):
            abandoned = True
            call.cancel()
    if cancel_abandoned:
        for _, f in chunk:
            f.add_done_callback(check)
    try:
        _settle(chunk, await call)
    except asyncio.CancelledError:
        for _, f in chunk:
            f.cancel()
        if not abandoned:
            raise
    except Exception as e:
        _settle(chunk, e)


def _settle(chunk: list[tuple[object, asyncio.Future]], results: "list | BaseException") -> None:
    for i, (_, f) in enumerate(chunk):
        if f.done():
            continue
        r = results if isinstance(results, BaseException) else results[i]
        if isinstance(r, BaseException):
            f.set_exception(r)
        else:
            f.set_result(r)
