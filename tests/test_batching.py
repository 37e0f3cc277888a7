"""MicroBatcher: same-turn calls fuse; serial mode fuses what waits while a batch runs; failures stay per item."""

import asyncio

import pytest

from app.coalesce import MicroBatcher


def test_calls_of_one_turn_fuse_per_key():
    seen = []

    def fn(items, key):
        seen.append((key, list(items)))
        return [i * 10 for i in items]

    async def go():
        b = MicroBatcher(fn)
        return await asyncio.gather(b.submit(1, "x"), b.submit(2, "y"), b.submit(3, "x"))
    assert asyncio.run(go()) == [10, 20, 30]
    assert sorted(seen) == [("x", [1, 3]), ("y", [2])]


def test_serial_batches_take_everything_that_waited_for_the_model():
    sizes, running = [], []

    async def forward(items):
        running.append(1)
        assert len(running) == 1, "two batches at once"
        await asyncio.sleep(0.05)
        running.pop()
        sizes.append(len(items))
        return items

    async def caller(b, i):
        await asyncio.sleep(0.01 * (i % 4))  # arrive while the first batch runs
        for _ in range(3):
            assert await b.submit(i) == i

    async def go():
        b = MicroBatcher(lambda items, _: forward(items), max_items=32, serial=True)
        await caller(b, 99)  # alone: batches of one
        await asyncio.gather(*(caller(b, i) for i in range(12)))
    asyncio.run(go())
    assert sizes[:3] == [1, 1, 1] and max(sizes) >= 8 and sum(sizes) == 3 + 36


def test_serial_respects_max_items():
    sizes = []

    async def forward(items):
        sizes.append(len(items))
        await asyncio.sleep(0)
        return items

    async def go():
        b = MicroBatcher(lambda items, _: forward(items), max_items=4, serial=True)
        return await asyncio.gather(*(b.submit(i) for i in range(10)))
    assert asyncio.run(go()) == list(range(10))
    assert sizes == [4, 4, 2]


def test_serial_cost_budget_takes_cheap_items_first_and_serves_everything():
    batches = []

    async def forward(items):
        batches.append(list(items))
        await asyncio.sleep(0)
        return items

    async def go():
        # costs: prompt chunks of 512 positions and verify rounds of 5, arriving interleaved
        b = MicroBatcher(lambda items, _: forward(items), serial=True, max_cost=1024, cost=lambda it: it[1])
        items = [("chunk-a", 512), ("round-1", 5), ("chunk-b", 512), ("round-2", 5), ("chunk-c", 512), ("huge", 4096)]
        return await asyncio.gather(*(b.submit(it) for it in items)), items
    results, items = asyncio.run(go())
    assert results == items  # every caller gets its own item back
    assert all(sum(c for _, c in batch) <= 1024 or len(batch) == 1 for batch in batches)
    # rounds first, then chunks in arrival order, while the budget lasts (a batch keeps arrival order)
    assert [name for name, _ in batches[0]] == ["chunk-a", "round-1", "round-2"]
    assert [name for name, _ in batches[1]] == ["chunk-b", "chunk-c"]
    assert sorted(name for batch in batches for name, _ in batch) == sorted(name for name, _ in items)
    assert [("huge", 4096)] in batches  # over the budget alone: it still runs, by itself


def test_serial_cost_budget_never_starves_an_expensive_item():
    batches = []

    async def go():
        b = None

        async def forward(items):
            batches.append([name for name, _ in items])
            if len(batches) < 6:  # every forward, a new cheap round arrives for the next one
                asyncio.ensure_future(b.submit((f"round-{len(batches)}", 1)))
            await asyncio.sleep(0)
            return items
        b = MicroBatcher(lambda items, _: forward(items), serial=True, max_cost=100, cost=lambda it: it[1])
        await asyncio.gather(b.submit(("round-0", 1)), b.submit(("prompt", 500)))
        for _ in range(50):  # let the last cheap rounds finish
            await asyncio.sleep(0)
    asyncio.run(go())
    assert batches[0] == ["round-0"] and batches[1] == ["prompt"]  # left out once, first the next time


def test_an_item_that_fails_fails_alone_and_a_cancelled_caller_is_not_sent():
    sent = []

    async def fn(items):
        sent.extend(items)
        return [ValueError(i) if i == 2 else i for i in items]

    async def go():
        b = MicroBatcher(lambda items, _: fn(items))
        gone = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0)
        gone.cancel()
        ok, bad = b.submit(1), b.submit(2)
        return await asyncio.gather(ok, bad, return_exceptions=True)
    one, two = asyncio.run(go())
    assert one == 1 and isinstance(two, ValueError)
    assert 0 not in sent


def test_a_batch_that_raises_fails_its_callers_only():
    async def go():
        calls = 0

        async def fn(items):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("replica gone")
            return items
        b = MicroBatcher(lambda items, _: fn(items), serial=True)
        with pytest.raises(RuntimeError):
            await asyncio.gather(b.submit(1), b.submit(2))
        return await b.submit(3)
    assert asyncio.run(go()) == 3


def test_a_call_every_caller_left_is_cancelled_but_a_serial_forward_is_not():
    async def go(serial: bool):
        state = {"cancelled": False, "finished": False}

        async def stuck(items):
            try:
                await asyncio.sleep(0.2)
                state["finished"] = True
                return items
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise
        b = MicroBatcher(lambda items, _: stuck(items), serial=serial)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.submit(1), 0.05)
        await asyncio.sleep(0.3)
        return state
    assert asyncio.run(go(serial=False)) == {"cancelled": True, "finished": False}
    assert asyncio.run(go(serial=True)) == {"cancelled": False, "finished": True}
