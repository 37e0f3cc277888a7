"""A TargetServer replica's way to the draft pool: one deployment call per step for all its sequences.

The rounds of the sequences a replica verified together finish together, so their next proposals
are asked for in the same event-loop turn; the client sends them as one `Calls` per draft replica
(each Serve call costs milliseconds of Ray and Serve bookkeeping). A sequence's calls go to its
home, the draft replica that holds its draft KV cache; `Homes` (deployments.affinity) places new
sequences and rebalances when the pool grows or shrinks. Any failure of the draft pool reaches the
engine as DraftUnavailable: that sequence fails open.
"""

import asyncio
import logging
from collections.abc import Callable

from app.coalesce import MicroBatcher
from app.speculation.driver import DraftUnavailable
from app.speculation.steps import Proposal, ProposeItem, family, parent_of
from deployments.affinity import Calls, Homes, members
from deployments.contexts import ContextUnknown, SentContexts
from deployments.dispatch import own_serve_request

log = logging.getLogger("ray.serve")


class DraftClient:
    """propose / release against a DraftServer deployment handle (the engine's draft transport)."""

    def __init__(self, handle, max_batch: int | None = None, wait_share: Callable[[], float] | None = None,
                 pool: Callable[[], frozenset[str] | None] | None = None):
        self.handle = handle
        # the share of this replica's round time spent waiting for proposals, sent with every call:
        # the draft pool's autoscaling signal (deployments/autoscaling.py)
        self.wait_share = wait_share or (lambda: 0.0)
        # the draft pool's replica ids as this process's router sees them (None before its first call)
        self.pool = pool or (lambda: members(handle.app_name, handle.deployment_name))
        self.homes = Homes()
        self.moved = 0  # sequences moved to another draft replica when the pool changed
        self._calls = MicroBatcher(self._call, max_batch)
        self._releases: set[asyncio.Task] = set()
        self.sent = SentContexts()  # each sequence's context as sent: a call carries only the new tokens
        self.resent = 0  # items a draft replica did not hold the context of, sent again whole

    def _call(self, items: list[ProposeItem], home: str | None):
        with own_serve_request():  # several calls of one target request may be in flight at once
            return self.handle.propose_many.remote(Calls(self.sent.encode(items), home, wait_share=self.wait_share()))

    async def _ask(self, item: ProposeItem, home: str | None) -> Proposal:
        """One proposal; sent again whole where the replica that took the call lacked its context (the
        call went elsewhere than before, or the replica let the context go)."""
        try:
            return await self._calls.submit(item, home)
        except ContextUnknown:
            self.resent += 1
            self.sent.drop(item.seq_id)
            return await self._calls.submit(item, home)

    async def submit(self, item: ProposeItem) -> Proposal:
        pool = self.pool()
        for old, seq_ids in self.homes.settle(pool).items():  # the pool changed: free what moved away
            self.moved += len(seq_ids)
            for branch in (b for seq_id in seq_ids for b in family(seq_id)):  # their new home holds no context
                self.sent.drop(branch)
            task = asyncio.ensure_future(self._release(seq_ids, old))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        request = parent_of(item.seq_id)  # a request's branches live where its own cache does
        home = self.homes.place(request, pool)
        try:
            proposal = await self._ask(item, home)
        except Exception as e:  # a dead replica, an overloaded pool, a bad answer: all fail open
            self.homes.forget(request)  # its home may be gone: let the next call be placed afresh
            self.sent.drop(item.seq_id)
            log.warning("draft pool failed for %s: %s", item.seq_id, type(e).__name__)
            raise DraftUnavailable(f"{type(e).__name__}: {e}") from e
        if "replica" in proposal.stats:
            self.homes.record(request, home, proposal.stats["replica"])
        return proposal

    async def release(self, seq_id: str) -> None:
        """Free the request's draft caches (its own and its branches') on its home replica; a gone
        replica took them along."""
        for branch in family(seq_id):
            self.sent.drop(branch)
        await self._release(family(seq_id), self.homes.forget(seq_id))

    async def _release(self, seq_ids: list[str], home: str | None) -> None:
        try:
            await self.handle.release.remote(Calls(seq_ids, home))
        except Exception as e:
            log.info("draft cache release for %s failed: %s", seq_ids, type(e).__name__)
