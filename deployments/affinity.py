"""Session affinity: every call of one sequence goes to the same replica, so its KV cache is reused.

Rendezvous hashing on the sequence id picks the preferred replica; if it cannot take the request
(queue full), the other replicas are tried least-loaded first via Serve's power-of-two fallback.
Affinity is a speed-up only: any replica computes the same answer from the full token ids.
"""

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


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
    """Routes a sequence to its rendezvous-hash replica, then to the others in hash order."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        seq = sequence_id(pending_request)
        if seq is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _score(seq, r.replica_id.unique_id), reverse=True)
        return [[ranked[0]], ranked[1:]]
