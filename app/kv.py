"""Per-sequence KV caches with prefix reuse, rollback and an LRU memory budget.

transformers' caches hold one batch; a server needs caches that outlive a batch and are regrouped
into a new batch every round, so this store keeps each sequence's keys and values on its own and
lends them to a batched transformers cache for one forward.

Each sequence's KV lives in a buffer with spare capacity (a slab): a round writes only its new
positions into it, and rolling back is forgetting positions, so no round copies a whole cache.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable
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


PREFIX_BLOCK = 16  # tokens per block of the prefix index: a shared prefix is found to the block, then exactly


def block_keys(token_ids: list[int], start: int = 0, salt: str | None = None):
    """(block end, key) for each whole block of token_ids: the key names the whole prefix up to that end,
    under the sequence's cache salt (None, the shared scope, keys as before)."""
    key = None if salt is None else hash(("cache_salt", salt))
    for end in range(PREFIX_BLOCK, len(token_ids) + 1, PREFIX_BLOCK):
        key = hash((key, tuple(token_ids[end - PREFIX_BLOCK : end])))
        if end > start:
            yield end, key


class KVStore:
    """Sequence id -> SequenceCache, least recently used evicted first when over budget, with
    automatic prefix caching: a new sequence starts from a copy of the longest prefix any cached
    sequence shares with it (the same system prompt, a chat's earlier turns, a retried request).

    A released sequence is not dropped but retired: its KV stays as a prefix donor until the
    budget needs the room, and retired entries are evicted before any live one. The budget counts
    slabs' whole capacity, spare room included: it bounds real memory.

    A prefix index maps each block of cached tokens, keyed by the whole prefix it ends, to a
    sequence holding it. A hit is always confirmed on the token ids themselves, so the index may
    be stale or collide without ever changing a result. Reused keys and values are what the
    sequence's own prefill computes for the same tokens at the same positions; as with any
    batched forward, only float rounding from the batch's shape can differ.

    Prefixes are shared only within a cache salt (a request's `cache_salt`; None is the shared scope):
    time to first token must not tell one client whether another's prompt is cached. The salt starts
    each key chain and a hit is confirmed on it as on the token ids.

    `on_drop(seq_id)` runs whenever a sequence's entry goes (dropped or evicted), so state the runner
    keeps beside it (grammar matchers) goes with it. It runs under the store's lock, on the forward's
    thread: it must not call back into the store.

    Forwards run in a worker thread while releases come from the event loop: a lock guards the map.
    """

    def __init__(self, max_bytes: int, on_drop: Callable[[str], None] = lambda seq_id: None):
        self.max_bytes = max_bytes
        self.on_drop = on_drop
        self._entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes accounted per entry when it was last put
        self._retired: OrderedDict[str, None] = OrderedDict()  # released, kept as prefix donors; oldest first
        self._index: dict[int, str] = {}  # block key -> a sequence id that held that prefix
        self._keys: dict[str, list[int]] = {}  # sequence id -> the block keys indexed for it, in order
        self._salts: dict[str, str] = {}  # sequence id -> its cache salt, where it has one
        self.nbytes = 0
        self.evictions = 0
        self.prefix_hit_tokens = 0  # prompt tokens not recomputed thanks to another sequence's cache
        self._lock = threading.RLock()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries and seq_id not in self._retired

    def __len__(self) -> int:
        """Live sequences (retired prefix donors not counted)."""
        return len(self._entries) - len(self._retired)

    def get(self, seq_id: str) -> SequenceCache | None:
        with self._lock:
            entry = self._entries.get(seq_id)
            if entry is not None:
                self._entries.move_to_end(seq_id)
            return entry

    def borrow(self, token_ids: list[int], limit: int, salt: str | None = None) -> SequenceCache | None:
        """A new cache holding a copy of the longest prefix of token_ids cached under the same salt (at
        most `limit` positions, at least one block), or None."""
        with self._lock:
            donor = None
            for end, key in block_keys(token_ids[:limit], salt=salt):
                seq_id = self._index.get(key)
                if seq_id is None:
                    break
                donor = seq_id
            entry = self._entries.get(donor) if donor is not None else None
            if entry is None or self._salts.get(donor) != salt:
                return None
            n = min(common_prefix(entry.token_ids, token_ids), limit)
            if n < PREFIX_BLOCK:
                return None
            self.prefix_hit_tokens += n
            if donor in self._retired:
                self._retired.move_to_end(donor)  # recently useful: evicted last among the retired
            return entry.copy_prefix(n)

    def put(self, seq_id: str, entry: SequenceCache, salt: str | None = None) -> None:
        """Store (or re-account, after it grew) a sequence's cache, live (a retired one stored again is
        live again), a prefix donor for sequences of the same salt. Room is made first, so readers on
        another thread never see the budget exceeded: retired sequences go first, then the least
        recently used live ones. An entry larger than the whole budget is not kept."""
        with self._lock:
            self._forget(seq_id)
            while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
                # an evicted sequence is recomputed from its token ids on its next call: slower, never wrong
                self.drop(next(iter(self._retired)) if self._retired else next(iter(self._entries)))
                self.evictions += 1
            if entry.nbytes > self.max_bytes:
                self.drop(seq_id)
                self.evictions += 1
                return
            self._entries[seq_id] = entry
            self._sizes[seq_id] = entry.nbytes
            self.nbytes += entry.nbytes
            if salt is not None:
                self._salts[seq_id] = salt
            self._reindex(seq_id, entry.token_ids)

    def retire(self, seq_id: str) -> None:
        """A finished sequence: keep its KV as a prefix donor while the budget has room."""
        with self._lock:
            if seq_id in self._entries:
                self._retired[seq_id] = None
                self._retired.move_to_end(seq_id)

    def drop(self, seq_id: str) -> None:
        """Free a sequence's cache now (and, through on_drop, what the runner keeps beside it)."""
        with self._lock:
            self._forget(seq_id)
            self._unindex(seq_id, 0)
            self.on_drop(seq_id)

    def _reindex(self, seq_id: str, token_ids: list[int]) -> None:
        """Index the whole blocks of token_ids; blocks indexed before that no longer match are replaced.
        Hashing a sequence's blocks costs about a microsecond per block and runs once per round."""
        keys = [key for _, key in block_keys(token_ids, salt=self._salts.get(seq_id))]
        old = self._keys.get(seq_id, [])
        same = next((i for i, (a, b) in enumerate(zip(old, keys)) if a != b), min(len(old), len(keys)))
        self._unindex(seq_id, same)
        for key in keys[same:]:
            self._index[key] = seq_id
        if keys:
            self._keys[seq_id] = keys

    def _unindex(self, seq_id: str, blocks: int) -> None:
        """Keep only the first `blocks` index entries of seq_id."""
        keys = self._keys.get(seq_id, [])
        for key in keys[blocks:]:
            if self._index.get(key) == seq_id:
                del self._index[key]
        del keys[blocks:]
        if not keys:
            self._keys.pop(seq_id, None)

    def _forget(self, seq_id: str) -> None:
        if self._entries.pop(seq_id, None) is not None:
            self.nbytes -= self._sizes.pop(seq_id)
        self._retired.pop(seq_id, None)
        self._salts.pop(seq_id, None)
