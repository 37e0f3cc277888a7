"""Per-sequence KV caches with prefix reuse, rollback and an LRU memory budget.

transformers' caches hold one batch; a server needs caches that outlive a batch and are regrouped
into a new batch every round, so this store keeps each sequence's keys and values on its own and
lends them to a batched transformers cache for one forward.

Each sequence's KV lives in a buffer with spare capacity (a slab): a round writes only its new
positions into it, and rolling back is forgetting positions, so no round copies a whole cache.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


def grown_capacity(length: int) -> int:
    """Capacity for a slab that must hold `length` positions: a quarter spare, at least 16."""
    return length + max(16, length // 4)


@dataclass
class SequenceCache:
    """The KV of one sequence: the token ids it covers and per layer (keys, values) slabs of [H, capacity, D].

    Only the first len(token_ids) positions of a slab are valid; the rest is room to grow.
    """

    token_ids: list[int]
    slabs: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of the valid positions: views [H, L, D]."""
        n = len(self.token_ids)
        return [(k[:, :n], v[:, :n]) for k, v in self.slabs]

    @property
    def capacity(self) -> int:
        return self.slabs[0][0].shape[1] if self.slabs else 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slabs)

    def __len__(self) -> int:
        return len(self.token_ids)

    def copy_prefix(self, length: int) -> "SequenceCache":
        """A new cache holding a copy of the first `length` positions (a second row of one sequence)."""
        cap = grown_capacity(length)
        slabs = []
        for k, v in self.slabs:
            k2, v2 = k.new_empty(k.shape[0], cap, k.shape[2]), v.new_empty(v.shape[0], cap, v.shape[2])
            k2[:, :length], v2[:, :length] = k[:, :length], v[:, :length]
            slabs.append((k2, v2))
        return SequenceCache(self.token_ids[:length], slabs)

    def reserve(self, length: int) -> None:
        """Make room for `length` positions, keeping the valid ones (amortised: grows by a quarter)."""
        if length <= self.capacity:
            return
        n, cap = len(self.token_ids), grown_capacity(length)
        grown = []
        for k, v in self.slabs:
            k2, v2 = k.new_empty(k.shape[0], cap, k.shape[2]), v.new_empty(v.shape[0], cap, v.shape[2])
            k2[:, :n], v2[:, :n] = k[:, :n], v[:, :n]
            grown.append((k2, v2))
        self.slabs = grown


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVStore:
    """Sequence id -> SequenceCache, least recently used evicted first when over budget.

    The budget counts slabs' whole capacity, spare room included: it bounds real memory.
    Forwards run in a worker thread while releases come from the event loop: a lock guards the map.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes accounted per entry when it was last put
        self.nbytes = 0
        self.evictions = 0
        self._lock = threading.RLock()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, seq_id: str) -> SequenceCache | None:
        with self._lock:
            entry = self._entries.get(seq_id)
            if entry is not None:
                self._entries.move_to_end(seq_id)
            return entry

    def put(self, seq_id: str, entry: SequenceCache) -> None:
        """Store (or re-account, after it grew) a sequence's cache, evicting the least recently used."""
        with self._lock:
            self.drop(seq_id)
            self._entries[seq_id] = entry
            self._sizes[seq_id] = entry.nbytes
            self.nbytes += entry.nbytes
            while self.nbytes > self.max_bytes and self._entries:
                # an evicted sequence is recomputed from its token ids on its next call: slower, never wrong
                old_id, _ = self._entries.popitem(last=False)
                self.nbytes -= self._sizes.pop(old_id)
                self.evictions += 1

    def drop(self, seq_id: str) -> None:
        with self._lock:
            if self._entries.pop(seq_id, None) is not None:
                self.nbytes -= self._sizes.pop(seq_id)
