"""A TargetServer replica's way to the draft pool: one deployment call per step for all its sequences.

The rounds of the sequences a replica verified together finish together, so their next proposals
are asked for in the same event-loop turn; the client sends them as one `Calls` per draft replica
(each Serve call costs milliseconds of Ray and Serve bookkeeping). A sequence's calls go to the
draft replica that served it last (its home, where its draft KV cache is), see deployments.affinity.
Any failure of the draft pool reaches the engine as DraftUnavailable: that sequence fails open.
"""

import logging
from collections.abc import Callable

from app.batching import MicroBatcher
from app.driver import DraftUnavailable
from app.spec import Proposal, ProposeItem
from deployments.affinity import Calls
from deployments.router import own_serve_request

log = logging.getLogger("ray.serve")


class DraftClient:
    """propose / release against a DraftServer deployment handle (the engine's draft transport)."""

    def __init__(self, handle, max_batch: int | None = None, wait_share: Callable[[], float] | None = None):
        self.handle = handle
        # the share of this replica's round time spent waiting for proposals, sent with every call:
        # the draft pool's autoscaling signal (deployments/autoscaling.py)
        self.wait_share = wait_share or (lambda: 0.0)
        self._homes: dict[str, str] = {}  # seq id -> draft replica id
        self._calls = MicroBatcher(self._call, max_batch)

    def _call(self, items: list[ProposeItem], home: str | None):
        with own_serve_request():  # several calls of one target request may be in flight at once
            return self.handle.propose_many.remote(Calls(items, home, wait_share=self.wait_share()))

    async def submit(self, item: ProposeItem) -> Proposal:
        try:
            proposal = await self._calls.submit(item, self._homes.get(item.seq_id))
        except Exception as e:  # a dead replica, an overloaded pool, a bad answer: all fail open
            self._homes.pop(item.seq_id, None)  # its home may be gone: let the next call go anywhere
            log.warning("draft pool failed for %s: %s", item.seq_id, type(e).__name__)
            raise DraftUnavailable(f"{type(e).__name__}: {e}") from e
        if "replica" in proposal.stats:
            self._homes[item.seq_id] = proposal.stats["replica"]
        return proposal

    async def release(self, seq_id: str) -> None:
        """Free the sequence's draft cache on its home replica; a gone replica took it along."""
        home = self._homes.pop(seq_id, None)
        try:
            await self.handle.release.remote(Calls([seq_id], home))
        except Exception as e:
            log.info("draft cache release for %s failed: %s", seq_id, type(e).__name__)
