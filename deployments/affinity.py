"""Session affinity: every call of one sequence goes to the same replica, so its KV cache is reused.

A target replica sends the proposals of many sequences as one `Calls` (deployments/draft_client.py),
grouped by the draft replica that holds each sequence's cache (its home, named by `replica_hint`).
`Homes` chooses the homes from the pool's members as this process's router last saw them: a new
sequence goes to the member with the fewest of this replica's sequences, and when the pool grows, the
busiest homes hand their excess to the new members (M:N pairing under autoscaling). If a home cannot
take the request (queue full) or is gone, the others are tried least-loaded first via Serve's
power-of-two fallback. Affinity is a speed-up only: any replica computes the same answer from the
full token ids (a call carries each sequence's new tokens, and a replica that lacks the rest says
so and gets them: deployments/contexts.py), so a sequence that moves re-prefills its draft cache
once and its output is unchanged.
"""

import hashlib
import random
from collections import Counter
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


# Each process's view of the draft pool: replica ids per (application, deployment), published by its
# SessionAffinityRouter whenever Serve tells the router of a change, read by the DraftClient of that
# process. Serve's handles expose no replica set; the router is the one place that learns of it.
_MEMBERS: dict[tuple[str, str], frozenset[str]] = {}


def members(app_name: str, deployment: str) -> frozenset[str] | None:
    """The replica ids of a deployment as this process's router last saw them (None: not routed yet)."""
    return _MEMBERS.get((app_name, deployment))


class Homes:
    """Which draft replica holds each sequence's draft cache, as one target replica places them.

    A sequence stays on its home while that home is a member of the pool. A new sequence, or one whose
    home left, goes to the member holding the fewest of this replica's sequences (ties by rendezvous
    hashing, so no choice depends on dict order). When members join, sequences move from the busiest
    home to the emptiest member, one at a time, until no two members differ by more than one: only the
    excess moves, every other sequence keeps its cache. Counts are this replica's sequences: each target
    replica balances its own, so the pool's totals balance too, without the replicas talking.
    """

    def __init__(self):
        self._home: dict[str, str] = {}
        self._count: Counter[str] = Counter()
        self._members: frozenset[str] | None = None
        # sequences whose home left the pool: the first replica to answer one of them becomes its home
        # (a call in flight when its home left was sent elsewhere by Serve, which built its cache there)
        self._orphans: set[str] = set()

    def __len__(self) -> int:
        return len(self._home)

    def get(self, seq_id: str) -> str | None:
        return self._home.get(seq_id)

    def counts(self) -> dict[str, int]:
        """{replica: sequences homed there}, for replicas holding any."""
        return {home: n for home, n in self._count.items() if n}

    def settle(self, members: frozenset[str] | None) -> dict[str, list[str]]:
        """Take in the pool's members; returns {old home: sequences moved away from it} (to free there)."""
        if members is None or members == self._members:
            return {}
        for seq_id, home in list(self._home.items()):
            if home not in members:  # its cache left with the replica: placed afresh on its next call
                self.forget(seq_id)
                self._orphans.add(seq_id)
        moved: dict[str, list[str]] = {}
        if members - (self._members or frozenset()):
            while True:
                busiest = max(members, key=lambda m: (self._count[m], m))
                emptiest = min(members, key=lambda m: (self._count[m], m))
                if self._count[busiest] - self._count[emptiest] <= 1:
                    break
                seq_id = max((s for s, h in self._home.items() if h == busiest), key=lambda s: _score(s, emptiest))
                self._set(seq_id, emptiest)
                moved.setdefault(busiest, []).append(seq_id)
        self._members = members
        return moved

    def place(self, seq_id: str, members: frozenset[str] | None) -> str | None:
        """The replica this sequence's next call goes to (None, members unknown: the router's rendezvous)."""
        home = self._home.get(seq_id)
        if members is None or home in members:
            return home
        home = min(members, key=lambda m: (self._count[m], -_score(seq_id, m)))
        self._set(seq_id, home)
        return home

    def record(self, seq_id: str, sent_to: str | None, served_by: str) -> None:
        """The replica that answered a call sent to `sent_to`; ignored when the sequence moved meanwhile,
        unless its home left the pool and this replica is still in it."""
        if self._home.get(seq_id) == sent_to or (
                seq_id in self._orphans and (self._members is None or served_by in self._members)):
            self._set(seq_id, served_by)

    def forget(self, seq_id: str) -> str | None:
        self._orphans.discard(seq_id)
        home = self._home.pop(seq_id, None)
        if home is not None:
            self._count[home] -= 1
        return home

    def _set(self, seq_id: str, home: str) -> None:
        self.forget(seq_id)
        self._home[seq_id] = home
        self._count[home] += 1


class SessionAffinityRouter(RequestRouter):
    """Routes calls to their home replica, else to their first sequence's rendezvous-hash replica; then
    the others. Publishes the replica set to this process's `Homes` (see `members`)."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        key = (self._deployment_id.app_name, self._deployment_id.name)
        _MEMBERS[key] = frozenset(r.unique_id for r in self._replicas)

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
