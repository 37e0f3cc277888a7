"""Per-sequence KV caches with prefix reuse, rollback and an LRU memory budget.

transformers' caches hold one batch; a server needs caches that outlive a batch and are regrouped
into a new batch every round, so this store keeps each sequence's keys and values on its own and
lends them to a batched transformers `DynamicCache` for one forward.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class SequenceCache:
    """The KV of one sequence: the token ids it covers and per layer (keys, values) of [H, L, D]."""

    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def __len__(self) -> int:
        return len(self.token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVStore:
    """Sequence id -> SequenceCache, least recently used evicted first when over budget."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, seq_id: str) -> SequenceCache | None:
        entry = self._entries.get(seq_id)
        if entry is not None:
            self._entries.move_to_end(seq_id)
        return entry

    def put(self, seq_id: str, entry: SequenceCache) -> None:
        self.drop(seq_id)
        self._entries[seq_id] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes and self._entries:
            # an evicted sequence is recomputed from its token ids on its next call: slower, never wrong
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1

    def drop(self, seq_id: str) -> None:
        old = self._entries.pop(seq_id, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll a sequence back to its first `length` tokens (rejected draft positions go)."""
        entry = self._entries.get(seq_id)
        if entry is None or len(entry) <= length:
            return
        self.nbytes -= entry.nbytes
        entry.token_ids = entry.token_ids[:length]
        entry.layers = [(k[:, :length].clone(), v[:, :length].clone()) for k, v in entry.layers]
        self.nbytes += entry.nbytes
