"""In-process micro-batching of concurrent rounds.

Serve deployments batch with `@serve.batch`; the engine must not import Ray, so in process a
small batcher plays that part: calls made in the same event-loop turn run as one batch.
"""

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Item, Result = TypeVar("Item"), TypeVar("Result")


class MicroBatcher(Generic[Item, Result]):
    """Collects `submit` calls until the loop has run every ready coroutine, then runs fn once."""

    def __init__(self, fn: Callable[[list[Item]], list[Result]]):
        self.fn = fn
        self.pending: list[tuple[Item, asyncio.Future]] = []
        self.batch_sizes: list[int] = []

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((item, future))
        if len(self.pending) == 1:
            # call_soon runs after the coroutines already woken this turn have submitted theirs
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        self.batch_sizes.append(len(batch))
        try:
            results = self.fn([item for item, _ in batch])
        except Exception as e:  # one bad batch fails its callers, not the loop
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), r in zip(batch, results):
            if not f.done():
                f.set_result(r)
