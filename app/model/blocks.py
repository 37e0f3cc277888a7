"""The pieces of the paged KV cache (app/model/kv.py): blocks of BLOCK_SIZE positions in one pool per
model, a sequence's block table (SequenceCache), and the chain hashes that index whole blocks by
their token ids for prefix sharing."""

from dataclasses import dataclass, field

import torch

# positions per block; also the prefix index's unit: a shared prefix is found to the block, then exactly
BLOCK_SIZE = 16
PREFIX_BLOCK = BLOCK_SIZE


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what a forward must write, even after evicting every other sequence."""


def grown_capacity(length: int) -> int:
    """Positions a batch buffer reserves to hold `length`: a quarter spare, at least 16."""
    return length + max(16, length // 4)


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK_SIZE)


@dataclass
class SequenceCache:
    """One sequence's KV: the token ids whose positions are valid and the table of blocks holding them
    (it may hold spare blocks past its length: room to grow without moving)."""

    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK_SIZE

    def runs(self, length: int) -> list[tuple[int, int]]:
        """The slots of positions [0, length) as runs of consecutive slots: [(first slot, end slot)]."""
        out: list[tuple[int, int]] = []
        for i in range(blocks_for(length)):
            start = self.blocks[i] * BLOCK_SIZE
            end = start + min(BLOCK_SIZE, length - i * BLOCK_SIZE)
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        return out

    def slots(self, start: int, end: int) -> list[int]:
        """The pool slot of each position in [start, end)."""
        return [self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a cached context extended), compared at C speed
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def block_keys(token_ids: list[int], start: int = 0, salt: str | None = None, key: int | None = None):
    """(block end, key) for each whole block of token_ids ending past `start`: the key names the whole
    prefix up to that end, under the sequence's cache salt (None, the shared scope). `key`: the chain's
    key at `start` (a multiple of the block) when already known, so only later blocks are hashed."""
    if key is None:
        key, first = (None if salt is None else hash(("cache_salt", salt))), BLOCK_SIZE
    else:
        first = start + BLOCK_SIZE
    for end in range(first, len(token_ids) + 1, BLOCK_SIZE):
        key = hash((key, tuple(token_ids[end - BLOCK_SIZE : end])))
        if end > start:
            yield end, key


class BlockPool:
    """Per layer a keys and a values tensor [kv heads, blocks * BLOCK_SIZE, head dim]; a reference
    count per block; free blocks as a byte map (1 = free), searched for runs at C speed."""

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, zeroed: bool = False):
        shape = (heads, num_blocks * BLOCK_SIZE, head_dim)
        # empty, not zeros: a CPU allocation is only committed as blocks are written. zeroed: for
        # attention that reads whole blocks of the pool and masks (FlexAttention), where a never-written
        # slot's garbage could be NaN, and a masked NaN value still makes 0 * NaN
        new = torch.zeros if zeroed else torch.empty
        self.keys = [new(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [new(shape, dtype=dtype, device=device) for _ in range(layers)]
        # every layer's keys tensor's address, then every layer's values': how the C++ attention op finds a
        # layer's (app/model/cpu_attention.py bind)
        self.addresses = torch.tensor([t.data_ptr() for t in self.keys + self.values], dtype=torch.int64)
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free_map = bytearray(b"\x01") * num_blocks
        self.free = num_blocks
        self.block_bytes = 2 * layers * heads * BLOCK_SIZE * head_dim * torch.finfo(dtype).bits // 8
        self.shape = (layers, heads, head_dim, dtype)

    def take(self, n: int, after: int | None = None, run_only: bool = False) -> list[int] | None:
        """n free blocks, referenced once: the ones right after block `after` when free, else a run of n
        consecutive blocks, else (unless run_only) any n; None when there are not."""
        if n <= 0:
            return []
        if n > self.free:
            return None
        start = -1
        if after is not None and self.free_map[after + 1 : after + 1 + n] == b"\x01" * n:
            start = after + 1
        if start < 0:
            start = self.free_map.find(b"\x01" * n)
        if start >= 0:
            ids = list(range(start, start + n))
        elif run_only:
            return None
        else:  # fragmented: the first n free blocks
            ids, i = [], 0
            while len(ids) < n:
                i = self.free_map.index(1, i)
                ids.append(i)
                i += 1
        for b in ids:
            self.free_map[b] = 0
            self.refs[b] = 1
        self.free -= n
        return ids

    def ref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def unref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_map[b] = 1
                self.free += 1

    def copy(self, src: int, dst: int, positions: int = BLOCK_SIZE) -> None:
        """Copy the first `positions` slots of block src into block dst, every layer."""
        a, b = src * BLOCK_SIZE, dst * BLOCK_SIZE
        for t in (*self.keys, *self.values):
            t[:, b : b + positions] = t[:, a : a + positions]
