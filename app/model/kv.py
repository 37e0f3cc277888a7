"""Paged KV caches: fixed-size blocks in one pool per model, a block table per sequence.

transformers' caches hold one batch; a server needs caches that outlive a batch and are regrouped
into a new batch every round. So a model's keys and values live in one pool of blocks of
BLOCK_SIZE positions, allocated once at the budget's size (on a GPU this is the memory vLLM's
`gpu_memory_utilization` leaves), and each sequence holds a table of the blocks its positions are
in. Nothing grows or moves while serving:

- Prefix sharing is by reference: a new sequence whose prompt starts like a cached one takes that
  sequence's whole blocks into its own table (a reference count each) and copies at most the one
  block the shared part ends in. A block is copied before a sequence writes into it while another
  holds it (copy on write).
- Rollback of rejected tokens is a length change: the positions past the kept length are written
  again by the next round, in the blocks the sequence already holds.
- Memory is the pool's: the budget is blocks, a sequence that cannot get blocks evicts the least
  recently used (finished donors first), and a context larger than the pool is refused at admission
  (`capacity_tokens`), never recomputed round after round.

The pool of each layer is laid out [kv heads, slots, head dim] (slot = block * BLOCK_SIZE + offset),
so a run of consecutive blocks is one strided view: attention reads a sequence whose table is one
run in place. The allocator therefore gives a sequence the blocks right after its last one where
they are free, and takes a quarter spare as it grows while the pool has room. On a CPU, reading in
place measures faster than any gather (docs/architecture.md has the figures): there a table that
ends a forward in several runs (a borrowed prefix, a fragmented pool) is moved into one run once
(`compact`), where the pool has one free; until then it is gathered per forward.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

# positions per block; also the prefix index's unit: a shared prefix is found to the block, then exactly
from app.model.blocks import (BLOCK_SIZE, PREFIX_BLOCK, BlockPool, OutOfBlocks, SequenceCache, block_keys, blocks_for,
                        common_prefix, grown_capacity)

__all__ = ["BLOCK_SIZE", "PREFIX_BLOCK", "BlockPool", "KVStore", "OutOfBlocks", "SequenceCache", "block_keys",
           "blocks_for", "common_prefix", "grown_capacity"]


class KVStore:
    """Sequence id -> SequenceCache over one BlockPool, least recently used evicted first, with
    automatic prefix caching: a new sequence starts from the longest prefix any cached sequence of
    the same cache salt shares with it (the same system prompt, a chat's earlier turns, a retried
    request), by reference to its blocks.

    A released sequence is not dropped but retired: its blocks stay as a prefix donor until the
    pool needs them, and retired entries are evicted before any live one. The budget counts every
    block a sequence holds, spare ones included: it bounds real memory.

    A prefix index maps each whole block of cached tokens, keyed by the whole prefix it ends, to a
    sequence holding it. A hit is always confirmed on the token ids themselves, so the index may be
    stale or collide without ever changing a result. Reused keys and values are what the sequence's
    own prefill computes for the same tokens at the same positions; as with any batched forward,
    only float rounding from the batch's shape can differ.

    Prefixes are shared only within a cache salt (a request's `cache_salt`; None is the shared scope):
    time to first token must not tell one client whether another's prompt is cached. The salt starts
    each key chain and a hit is confirmed on it as on the token ids.

    The pool is made at the first forward (its shapes are the model's keys'), at `max_bytes`;
    lowering max_bytes later evicts down to it. `on_drop(seq_id)` runs whenever a sequence's entry
    goes (dropped or evicted), so state the runner keeps beside it (grammar matchers) goes with it. It
    runs under the store's lock, on the forward's thread: it must not call back into the store.

    Forwards run in a worker thread while releases come from the event loop: a lock guards the maps.
    """

    def __init__(self, max_bytes: int, on_drop: Callable[[str], None] = lambda seq_id: None):
        self.max_bytes = max_bytes
        self.on_drop = on_drop
        self.pool: BlockPool | None = None
        self._entries: OrderedDict[str, SequenceCache] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()  # released, kept as prefix donors; oldest first
        self._index: dict[int, str] = {}  # block key -> a sequence id that held that prefix
        self._keys: dict[str, list[int]] = {}  # sequence id -> the block keys indexed for it, in order
        self._salts: dict[str, str] = {}  # sequence id -> its cache salt, where it has one
        self.evictions = 0
        self.prefix_hit_tokens = 0  # prompt tokens not recomputed thanks to another sequence's cache
        self._lock = threading.RLock()

    # -- the pool ---------------------------------------------------------------------------------
    def configure(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                  zeroed: bool = False) -> BlockPool:
        """The pool, made on first use at the budget's size (the same shapes every later call)."""
        if self.pool is None:
            per_block = 2 * layers * heads * BLOCK_SIZE * head_dim * torch.finfo(dtype).bits // 8
            self.pool = BlockPool(layers, heads, head_dim, dtype, device, max(1, self.max_bytes // per_block), zeroed)
        return self.pool

    @property
    def block_bytes(self) -> int:
        return self.pool.block_bytes if self.pool else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks sequences hold (each block once, however many share it)."""
        return (self.pool.num_blocks - self.pool.free) * self.pool.block_bytes if self.pool else 0

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks live sequences hold (each block once): what the pool cannot free without
        evicting a sequence in use. Retired prefix donors, evicted first and for free, are not counted.
        Safe to read from another thread while a forward runs (it reads snapshots)."""
        retired = set(self._retired)
        live = {b for seq_id, e in list(self._entries.items()) if seq_id not in retired for b in list(e.blocks)}
        return len(live) * self.block_bytes

    def entry_bytes(self, entry: SequenceCache) -> int:
        """Bytes of the blocks one sequence holds (shared ones included)."""
        return len(entry.blocks) * self.block_bytes

    def read(self, entry: SequenceCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values of one layer, [kv heads, len(entry), head dim] (a copy)."""
        slots = torch.tensor(entry.slots(0, len(entry)), device=self.pool.keys[layer].device, dtype=torch.long)
        return self.pool.keys[layer].index_select(1, slots), self.pool.values[layer].index_select(1, slots)

    def _limit_blocks(self) -> int:
        return min(self.pool.num_blocks, self.max_bytes // self.pool.block_bytes)

    def capacity_tokens(self, per_block_bytes: int) -> int:
        """Positions one sequence can hold at most: the whole budget in blocks of `per_block_bytes`."""
        blocks = self.max_bytes // per_block_bytes if self.pool is None else self._limit_blocks()
        return blocks * BLOCK_SIZE

    # -- sequences --------------------------------------------------------------------------------
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

    def prefix_len(self, token_ids: list[int], salt: str | None = None) -> int:
        """How many leading positions of token_ids a new sequence would borrow (0: none), borrowing nothing."""
        with self._lock:
            donor = None
            for _, key in block_keys(token_ids, salt=salt):
                if (seq_id := self._index.get(key)) is None:
                    break
                donor = seq_id
            entry = self._entries.get(donor) if donor is not None else None
            if entry is None or self._salts.get(donor) != salt:
                return 0
            n = common_prefix(entry.token_ids, token_ids)
            return n if n >= BLOCK_SIZE else 0

    def borrow(self, token_ids: list[int], limit: int, salt: str | None = None,
               protect: frozenset[str] = frozenset()) -> SequenceCache | None:
        """A new cache holding the longest prefix of token_ids cached under the same salt (at most
        `limit` positions, at least one block), or None: the donor's whole blocks by reference, the
        block the shared part ends in copied. Not stored: put() it, or free() it."""
        with self._lock:
            donor = None
            for _, key in block_keys(token_ids[:limit], salt=salt):
                seq_id = self._index.get(key)
                if seq_id is None:
                    break
                donor = seq_id
            entry = self._entries.get(donor) if donor is not None else None
            if entry is None or self._salts.get(donor) != salt:
                return None
            n = min(common_prefix(entry.token_ids, token_ids), limit)
            if n < BLOCK_SIZE:
                return None
            borrowed = self._share(entry, token_ids[:n], protect | {donor})
            if borrowed is None:
                return None
            self.prefix_hit_tokens += n
            if donor in self._retired:
                self._retired.move_to_end(donor)  # recently useful: evicted last among the retired
            return borrowed

    def borrow_own(self, entry: SequenceCache, n: int, protect: frozenset[str] = frozenset()) -> SequenceCache:
        """A second table over the first n positions of `entry` (a second row of one sequence in one
        batch): its whole blocks by reference, the block position n falls in copied."""
        with self._lock:
            shared = self._share(entry, entry.token_ids[:n], protect)
            if shared is None:
                raise OutOfBlocks("the KV cache has no block left for a second row of a sequence")
            return shared

    def _share(self, entry: SequenceCache, token_ids: list[int], protect: frozenset[str]) -> SequenceCache | None:
        """A new table holding token_ids (a prefix of entry's): entry's whole blocks referenced, the
        partly used last one copied; None when no block is left for that copy."""
        n = len(token_ids)
        whole = n // BLOCK_SIZE
        shared = entry.blocks[:whole]
        self.pool.ref(shared)
        out = SequenceCache(list(token_ids), list(shared))
        if n % BLOCK_SIZE:
            tail = self._take(1, None, protect)
            if tail is None:
                self.pool.unref(shared)
                return None
            self.pool.copy(entry.blocks[whole], tail[0], n % BLOCK_SIZE)
            out.blocks += tail
        return out

    def reserve(self, entry: SequenceCache, start: int, end: int, protect: frozenset[str] = frozenset()) -> None:
        """Make positions [start, end) of entry writable: blocks enough (a quarter spare), and any block
        in that range another sequence also holds copied first. Evicts others to make room; raises
        OutOfBlocks when even that cannot."""
        with self._lock:
            for i in range(start // BLOCK_SIZE, min(blocks_for(end), len(entry.blocks))):
                if self.pool.refs[entry.blocks[i]] > 1:  # shared: copy on write
                    (own,) = self._need(1, None, protect)
                    self.pool.copy(entry.blocks[i], own)
                    self.pool.unref([entry.blocks[i]])
                    entry.blocks[i] = own
            missing = blocks_for(end) - len(entry.blocks)
            if missing > 0:
                # a quarter spare, so the table grows in runs; taken only where no other sequence must go for it
                spare = blocks_for(end + end // 4) - len(entry.blocks)
                after = entry.blocks[-1] if entry.blocks else None
                used = self.pool.num_blocks - self.pool.free
                got = self.pool.take(spare, after) if used + spare <= self._limit_blocks() else None
                entry.blocks += got if got is not None else self._need(missing, after, protect)

    def compact(self, entry: SequenceCache) -> bool:
        """Move a table of several runs (a borrowed prefix, blocks taken where the pool had them) into
        one run of fresh blocks, so attention reads it in place from then on: one copy instead of a
        gather every forward. Only where a free run is there (it evicts nobody); True when moved."""
        with self._lock:
            n = len(entry.token_ids)
            need = blocks_for(n + n // 4)
            if self.pool.num_blocks - self.pool.free + need > self._limit_blocks():
                return False
            run = self.pool.take(need, run_only=True)
            if run is None:
                return False
            src = torch.tensor(entry.slots(0, n), device=self.pool.keys[0].device)
            start = run[0] * BLOCK_SIZE
            for t in (*self.pool.keys, *self.pool.values):
                t[:, start : start + n] = t.index_select(1, src)
            self.pool.unref(entry.blocks)
            entry.blocks = run
            return True

    def free(self, entry: SequenceCache) -> None:
        """Give back the blocks of an entry that was never stored (a borrowed cache whose forward failed)."""
        with self._lock:
            self.pool.unref(entry.blocks)
            entry.blocks = []

    def put(self, seq_id: str, entry: SequenceCache, salt: str | None = None, unchanged: int = 0) -> None:
        """Store (or re-account) a sequence's cache, live (a retired one stored again is live again), a
        prefix donor for sequences of the same salt. `unchanged`: leading positions whose tokens are
        the same as when it was last put (their index entries are kept, not hashed again). A different
        entry stored under seq_id replaces the old one, whose blocks are given back."""
        with self._lock:
            old = self._entries.get(seq_id)
            if old is not None and old is not entry:
                self._forget(seq_id)
                unchanged = 0
            self._retired.pop(seq_id, None)
            self._entries[seq_id] = entry
            self._entries.move_to_end(seq_id)
            if salt is not None:
                self._salts[seq_id] = salt
            self._reindex(seq_id, entry.token_ids, unchanged)
            self._fit(frozenset({seq_id}))

    def retire(self, seq_id: str) -> None:
        """A finished sequence: keep its KV as a prefix donor while the budget has room; its spare
        blocks go back at once."""
        with self._lock:
            entry = self._entries.get(seq_id)
            if entry is not None:
                keep = blocks_for(len(entry.token_ids))
                self.pool.unref(entry.blocks[keep:])
                del entry.blocks[keep:]
                self._retired[seq_id] = None
                self._retired.move_to_end(seq_id)

    def drop(self, seq_id: str) -> None:
        """Free a sequence's cache now (and, through on_drop, what the runner keeps beside it)."""
        with self._lock:
            self._forget(seq_id)
            self.on_drop(seq_id)

    # -- room -------------------------------------------------------------------------------------
    def _take(self, n: int, after: int | None, protect: frozenset[str]) -> list[int] | None:
        """n blocks within the budget, evicting others when needed; None when even that cannot."""
        while True:
            used = self.pool.num_blocks - self.pool.free
            if used + n <= self._limit_blocks():
                got = self.pool.take(n, after)
                if got is not None:
                    return got
            if not self._evict_one(protect):
                return None

    def _need(self, n: int, after: int | None, protect: frozenset[str]) -> list[int]:
        got = self._take(n, after, protect)
        if got is None:
            raise OutOfBlocks(f"the KV cache cannot hold {n} more blocks of {BLOCK_SIZE} positions: "
                              f"{self._limit_blocks()} blocks in all, the batch's own sequences hold the rest")
        return got

    def _fit(self, protect: frozenset[str]) -> None:
        """Evict until the blocks held are within max_bytes (it may have been lowered)."""
        while self.pool is not None and self.nbytes > self.max_bytes and self._evict_one(protect):
            pass

    def _evict_one(self, protect: frozenset[str]) -> bool:
        """Drop the oldest retired sequence, else the least recently used live one not in `protect`."""
        victim = next((s for s in self._retired if s not in protect), None)
        if victim is None:
            victim = next((s for s in self._entries if s not in protect), None)
        if victim is None:
            return False
        # an evicted sequence is recomputed from its token ids on its next call: slower, never wrong
        self.drop(victim)
        self.evictions += 1
        return True

    # -- the prefix index -------------------------------------------------------------------------
    def _reindex(self, seq_id: str, token_ids: list[int], unchanged: int) -> None:
        """Index the whole blocks of token_ids, hashing only those past the `unchanged` positions
        (about a microsecond per block)."""
        keys = self._keys.get(seq_id, [])
        keep = min(len(keys), unchanged // BLOCK_SIZE, len(token_ids) // BLOCK_SIZE)
        self._unindex(seq_id, keep)
        keys = self._keys.setdefault(seq_id, [])
        start = keep * BLOCK_SIZE
        for _, key in block_keys(token_ids, start, self._salts.get(seq_id), keys[-1] if keys else None):
            self._index[key] = seq_id
            keys.append(key)
        if not keys:
            del self._keys[seq_id]

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
        entry = self._entries.pop(seq_id, None)
        if entry is not None:
            self.pool.unref(entry.blocks)
            entry.blocks = []
        self._retired.pop(seq_id, None)
        self._unindex(seq_id, 0)
        self._salts.pop(seq_id, None)
