"""Session affinity: every call of one sequence goes to the same replica, so its KV cache is reused.

A target replica sends the proposals of many sequences as one `Calls` (deployments/draft_client.py),
grouped by the draft replica that served each sequence before (its home, named by `replica_hint`); a sequence without a home goes where
rendezvous hashing on its id points. If that replica cannot take the request (queue full) or is
gone, the others are tried least-loaded first via Serve's power-of-two fallback. Affinity is a
speed-up only: any replica computes the same answer from the full token ids.
"""

import hashlib
import random
from dataclasses import dataclass, field

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica


@dataclass
class Calls:
    """Several sequences' items (ProposeItems, VerifyItems or sequence ids) sent in one deployment call."""

    items: list = field(default_factory=list)
    replica_hint: str | None = None  # the replica that holds these sequences' caches, if any
    wait_share: float | None = None  # a target replica's recent share of round time waiting for proposals

    @property
    def seq_id(self) -> str | None:
        first = self.items[0] if self.items else None
        return getattr(first, "seq_id", first)


def sequence_id(pending: PendingRequest | None) -> str | None:
    """The sequence id a call is about: its first argument's seq_id, or the argument itself."""
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    seq = getattr(first, "seq_id", first)
    return seq if isinstance(seq, str) else None


def _score(seq_id: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seq_id}/{replica_id}".encode(), digest_size=8).digest(), "big")


class SessionAffinityRouter(RequestRouter):
    """Routes calls to their home replica, else to their first sequence's rendezvous-hash replica; then the others."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if len(candidate_replicas) <= 1:
            return [candidate_replicas]
        first = pending_request.args[0] if pending_request and pending_request.args else None
        hint = getattr(first, "replica_hint", None)
        home = [r for r in candidate_replicas if r.replica_id.unique_id == hint]
        if home:
            return [home, [r for r in candidate_replicas if r is not home[0]]]
        seq = sequence_id(pending_request)
        if seq is None:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _score(seq, r.replica_id.unique_id), reverse=True)
        return [[ranked[0]], ranked[1:]]


class ChoiceGroupRouter(LocalityMixin, RequestRouter):
    """TargetServer's router: Serve's power of two choices (two random replicas, this node's first;
    the shorter queue wins), except that jobs of one group (a prompt's n choices) all rank the same
    replica first, by rendezvous hashing on the group, so its engine prefills their prompt once; a
    full or gone home hands them to the others, as for any request."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        first = pending_request.args[0] if pending_request and pending_request.args else None
        group = getattr(first, "group", None)
        if group is not None and len(candidate_replicas) > 1:
            ranked = sorted(candidate_replicas, key=lambda r: _score(group, r.replica_id.unique_id), reverse=True)
            return [[ranked[0]], ranked[1:]]
        near = self.apply_locality_routing(pending_request)
        pool = [r for r in candidate_replicas if r.replica_id in near] or candidate_replicas
        return [random.sample(pool, min(2, len(pool)))]
