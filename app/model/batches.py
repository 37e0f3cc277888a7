"""The batches a ModelRunner runs: a forward over several sequences, then draft steps that extend it,
then the KV it keeps. RaggedBatch packs every sequence's new tokens into one row over the paged pool
(app/model/ragged.py); Batch pads them into a batch for models the ragged path does not support (sliding
windows, soft-capping). Each batch holds the ModelRunner that opened it (app/model/runner.py), which this
module does not import."""

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from app.model.hf_compat import with_cache
from app.model.kv import SequenceCache, common_prefix, grown_capacity
from app.model.ragged import LAYOUT, Layout, Span, active
from app.model.syncs import upload
from app.model.sessions import MODEL_CODE


@dataclass
class SeqInput:
    """One sequence of a batched forward: its full token ids and how many trailing logits it needs."""

    seq_id: str
    token_ids: list[int]
    num_logits: int = 1
    salt: str | None = None  # its request's cache_salt: it borrows only prefixes cached under the same one


class RaggedBatch:
    """A batch in flight as one packed row (app/model/ragged.py): no padding, no gather, no write-back.

    Each sequence computes in its own blocks of the pool; positions it no longer needs are a length
    change at close(). A second row of the same sequence in one batch (its proposal and one drafted
    ahead) computes in a table of its own that shares the first row's whole blocks.
    """

    def __init__(self, runner, seqs: list[SeqInput]):
        self.runner = runner
        store = runner.cache
        self.pool = runner.pool()
        self.seq_ids = [s.seq_id for s in seqs]
        self.salts = [s.salt for s in seqs]
        self.token_ids = [list(s.token_ids) for s in seqs]
        self.protect = frozenset(self.seq_ids)
        self.entries: list[SequenceCache] = []
        self.owned: list[bool] = []  # entries not in the store (borrowed, new, second rows): freed if unused
        spans, ids, offset, used = [], [], 0, set()
        try:
            for s in seqs:
                if not 1 <= s.num_logits <= len(s.token_ids):
                    raise ValueError(f"num_logits must be in [1, {len(s.token_ids)}], got {s.num_logits}")
                limit = len(s.token_ids) - s.num_logits
                entry = store.get(s.seq_id)
                owned = entry is None or s.seq_id in used
                if entry is None:
                    entry = store.borrow(s.token_ids, limit, s.salt, self.protect) or SequenceCache([])
                reuse = min(common_prefix(entry.token_ids, s.token_ids), limit)
                if s.seq_id in used:  # a second row: the first row's whole blocks, shared
                    entry = store.borrow_own(entry, reuse)
                    reuse = len(entry.token_ids)
                entry.token_ids = entry.token_ids[:reuse]  # forgotten now: a failed forward leaves it valid
                self.entries.append(entry)
                self.owned.append(owned)
                store.reserve(entry, reuse, len(s.token_ids), self.protect)
                used.add(s.seq_id)
                n = len(s.token_ids) - reuse
                spans.append(Span(entry, reuse, n, offset))
                ids += s.token_ids[reuse:]
                offset += n
            self.lengths = [s.start + s.length for s in spans]  # positions each table holds after this forward
            self.reuse = [s.start for s in spans]  # positions each sequence reused from its cache
            self.recomputed = offset
            keep = [sp.offset + sp.length - s.num_logits + j for sp, s in zip(spans, seqs) for j in range(s.num_logits)]
            out = self._run(ids, [p for sp in spans for p in range(sp.start, sp.start + sp.length)],
                            Layout(spans, self.pool, runner.attention), keep)
        except BaseException:
            self._free_owned()
            raise
        self.logits = list(out.split([s.num_logits for s in seqs]))

    def _free_owned(self) -> None:
        for entry, owned in zip(self.entries, self.owned):
            if owned:
                self.runner.cache.free(entry)

    def _run(self, ids: "list[int] | torch.Tensor", positions: list[int], layout: Layout, keep: list[int]) -> torch.Tensor:
        """One forward of the packed row (ids: a list, or a [1, T] tensor on the device); returns the
        logits at `keep` (flat indices), [len(keep), V] float32."""
        device, runner = self.runner.device, self.runner
        # the forward's indices in one host-to-device copy (app/model/syncs.py)
        parts = layout.parts()  # attention's own indices (gathers, the varlen plan)
        staged = upload([keep, positions, layout.slot_list] + parts
                        + ([] if isinstance(ids, torch.Tensor) else [ids]), device)
        index, position_ids, layout.slots = staged[0], staged[1].unsqueeze(0), staged[2]
        layout.take(staged[3 : 3 + len(parts)])
        input_ids = ids if isinstance(ids, torch.Tensor) else staged[-1].unsqueeze(0)
        bucket = runner.steps.bucket(len(positions)) if runner.steps else None
        if layout.flex:  # its mask is built here, eagerly: create_block_mask does not run inside a compiled step
            layout.block_mask(bucket or len(positions))
        with active(layout), MODEL_CODE.shared():  # never beside a compile session (app/model/sessions.py)
            if bucket:
                return runner.steps.logits(input_ids, position_ids, index)[:, : runner.vocab_size].float()
            extra = {"logits_to_keep": index} if runner.ragged_logits else {}
            out = runner.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False,
                attention_mask=torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device), **{LAYOUT: True}, **extra,
            ).logits[0]
        return (out if runner.ragged_logits else out[index])[:, : runner.vocab_size].float()

    @torch.inference_mode()
    def extend(self, tokens: "list[int] | torch.Tensor") -> torch.Tensor:
        """Feed one more token per row; returns next-token logits [B, V] float32. Tokens given as a
        tensor on the model's device stay there (no device-to-host copy per step): close() then takes
        their values."""
        store = self.runner.cache
        for entry, n in zip(self.entries, self.lengths):
            store.reserve(entry, n, n + 1, self.protect)
        spans = [Span(e, n, 1, i) for i, (e, n) in enumerate(zip(self.entries, self.lengths))]
        _append(self, tokens)
        ids = tokens.view(1, -1) if isinstance(tokens, torch.Tensor) else torch.tensor([tokens], device=self.runner.device)
        out = self._run(ids, self.lengths, Layout(spans, self.pool, self.runner.attention), list(range(len(spans))))
        self.lengths = [n + 1 for n in self.lengths]
        return out

    @torch.inference_mode()
    def close(self, keep: list[int], extended: list[list[int]] | None = None) -> None:
        """Store each row's first keep[i] positions as its cache (later positions are rolled back: a
        length change). A sequence's last row is the one stored. `extended`: per row the tokens fed to
        extend() as tensors, on the host."""
        _resolve(self, extended)
        store = self.runner.cache
        rows = zip(self.seq_ids, self.token_ids, self.entries, keep, self.lengths, self.salts, self.reuse, self.owned)
        for seq_id, ids, entry, n, length, salt, reuse, owned in rows:
            n = min(n, length)
            if n <= 0:
                if owned:
                    store.free(entry)
                store.drop(seq_id)
                continue
            entry.token_ids = ids[:n]
            if self.runner.compact_tables and len(entry.runs(n)) > 1:
                store.compact(entry)
            store.put(seq_id, entry, salt, unchanged=0 if owned else reuse)


def _append(batch, tokens) -> None:
    """Record one extend() step's tokens in the batch's token ids: now, or at close() for a tensor."""
    if isinstance(tokens, torch.Tensor):
        batch.deferred = getattr(batch, "deferred", 0) + 1
        return
    if getattr(batch, "deferred", 0):
        raise ValueError("extend() took tensors before: give every step as a tensor")
    for ids, t in zip(batch.token_ids, tokens):
        ids.append(t)


def _resolve(batch, extended: list[list[int]] | None) -> None:
    """Append the tokens of extend() steps given as tensors, from their host values."""
    steps = getattr(batch, "deferred", 0)
    if not steps:
        return
    if extended is None or any(len(e) < steps for e in extended):
        raise ValueError(f"close() needs the {steps} tokens each row was extended with")
    for ids, e in zip(batch.token_ids, extended):
        ids.extend(e[:steps])
    batch.deferred = 0


ROOM = 8  # spare positions a batch buffer gets beyond its prefill: the draft's extend() steps fill them


class _SlabLayer(DynamicLayer):
    """A cache layer over a preallocated [B, H, capacity, D] buffer: new positions are written in place.

    transformers' DynamicLayer concatenates, copying the whole cache at every forward; this layer
    copies only when its buffer is full (and then grows it by a quarter).
    """

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, length: int = 0):
        super().__init__()
        self.buffers = None if keys is None else (keys, values)
        self.length = length
        if keys is not None:
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self._expose()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, w, d = key_states.shape
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.buffers = (key_states.new_empty(b, h, w + ROOM, d), value_states.new_empty(b, h, w + ROOM, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        keys, values = self.buffers
        if end > keys.shape[2]:
            cap = grown_capacity(end)
            grown = []
            for t in (keys, values):
                g = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                g[:, :, : self.length] = t[:, :, : self.length]
                grown.append(g)
            self.buffers = keys, values = tuple(grown)
        keys[:, :, self.length : end] = key_states
        values[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _expose(self) -> None:
        keys, values = self.buffers
        self.keys, self.values = keys[:, :, : self.length], values[:, :, : self.length]


class Batch:
    """A ragged batch in flight: per-sequence caches gathered into one padded batch cache.

    Layout of row i in the KV axis: [left pad | reused prefix | new tokens | right pad | extended...];
    pads are masked out and positions are explicit, so every row sees exactly its own sequence.
    When no row needs padding (always at batch 1) the mask is dropped: the model's causal fast path.
    The models that take this path (sliding windows, soft-capping: app.model.ragged.supports_ragged) read
    their reused prefixes from the block pool into the batch buffer once, and close() writes back
    only the positions this batch computed.
    """

    def __init__(self, runner, seqs: list[SeqInput]):
        self.runner = runner
        store = runner.cache
        self.seq_ids = [s.seq_id for s in seqs]
        self.salts = [s.salt for s in seqs]
        self.token_ids = [list(s.token_ids) for s in seqs]
        self.protect = frozenset(self.seq_ids)
        device = runner.device
        reuse, entries, owned = [], [], []
        try:
            for s in seqs:
                if not 1 <= s.num_logits <= len(s.token_ids):
                    raise ValueError(f"num_logits must be in [1, {len(s.token_ids)}], got {s.num_logits}")
                entry = store.get(s.seq_id)
                owned.append(entry is None)
                if entry is None:
                    runner.pool()
                    entry = store.borrow(s.token_ids, len(s.token_ids) - s.num_logits, s.salt, self.protect)
                m = common_prefix(entry.token_ids, s.token_ids) if entry else 0
                reuse.append(min(m, len(s.token_ids) - s.num_logits))
                entries.append(entry)
        except BaseException:
            for e, o in zip(entries, owned):
                if o and e is not None:
                    store.free(e)
            raise
        self.owned = owned
        new = [s.token_ids[r:] for s, r in zip(seqs, reuse)]
        b, past, width = len(seqs), max(reuse), max(len(n) for n in new)

        input_ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, past + width, dtype=torch.long)
        for i, (r, n) in enumerate(zip(reuse, new)):
            input_ids[i, : len(n)] = torch.tensor(n)
            mask[i, past - r : past + len(n)] = 1
        positions = torch.tensor(reuse).unsqueeze(1) + torch.arange(width)  # [B, W]
        self.entries, self.reuse, self.new_lengths, self.past, self.width = entries, reuse, [len(n) for n in new], past, width
        try:
            self.cache = Cache(layers=self._gather(entries, reuse, past, width)) if past else Cache(
                layer_class_to_replicate=_SlabLayer)
            self.aligned = bool(mask.all())
            self.mask = mask.to(device)
            self.lengths = [r + len(n) for r, n in zip(reuse, new)]
            self.recomputed = sum(len(n) for n in new)
            v = runner.vocab_size
            keep = None
            if runner.ragged_logits:  # [B, W] True where a row needs a logit: its last num_logits new positions
                keep = torch.zeros(b, width, dtype=torch.bool)
                for i, (n, s) in enumerate(zip(new, seqs)):
                    keep[i, len(n) - s.num_logits : len(n)] = True
                keep = keep.to(device)
            out = self._run(input_ids.to(device), positions.to(device), torch.arange(past, past + width, device=device),
                            keep)
        except BaseException:
            self._free_owned()
            raise
        if keep is not None:  # out: [sum(num_logits), V], row-major
            self.logits = list(out[:, :v].float().split([s.num_logits for s in seqs]))
        else:
            self.logits = [out[i, len(n) - s.num_logits : len(n), :v].float() for i, (n, s) in enumerate(zip(new, seqs))]

    def _free_owned(self) -> None:
        for entry, owned in zip(self.entries, self.owned):
            if owned and entry is not None:
                self.runner.cache.free(entry)

    def _gather(self, entries, reuse: list[int], past: int, width: int) -> list[_SlabLayer]:
        """Per layer a buffer [B, H, past + width + ROOM, D] with each reused prefix left-padded to `past`."""
        pool = self.runner.pool()
        cap = past + width + ROOM
        rows = [(i, torch.tensor(e.slots(0, r), device=self.runner.device)) for i, (e, r) in enumerate(zip(entries, reuse))
                if r]
        layers = []
        for layer, (pk, pv) in enumerate(zip(pool.keys, pool.values)):
            keys = pk.new_zeros(len(entries), pk.shape[0], cap, pk.shape[2])  # pads masked out, but finite
            values = pv.new_zeros(len(entries), pv.shape[0], cap, pv.shape[2])
            for i, slots in rows:
                keys[i, :, past - len(slots) : past] = pk.index_select(1, slots)
                values[i, :, past - len(slots) : past] = pv.index_select(1, slots)
            layers.append(_SlabLayer(keys, values, past))
        return layers

    def _run(self, input_ids, positions, cache_position, keep: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if keep is None else {"logits_to_keep": keep}
        with MODEL_CODE.shared():  # never beside a compile session (app/model/sessions.py)
            out = self.runner.model(
                input_ids=input_ids, attention_mask=None if self.aligned else self.mask, position_ids=positions,
                cache_position=cache_position, use_cache=True, **with_cache(self.runner.model, self.cache), **extra,
            )
        return out.logits

    @torch.inference_mode()
    def extend(self, tokens: "list[int] | torch.Tensor") -> torch.Tensor:
        """Feed one more token per row; returns next-token logits [B, V] float32 (tokens as a tensor:
        see RaggedBatch.extend)."""
        device = self.runner.device
        _append(self, tokens)
        positions = torch.tensor(self.lengths, device=device).unsqueeze(1)
        self.lengths = [n + 1 for n in self.lengths]
        width = self.mask.shape[1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        ids = tokens.view(-1, 1) if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, device=device).unsqueeze(1)
        out = self._run(ids, positions, torch.tensor([width], device=device))
        return out[:, -1, : self.runner.vocab_size].float()

    @torch.inference_mode()
    def close(self, keep: list[int], extended: list[list[int]] | None = None) -> None:
        """Store each row's first keep[i] positions as its cache (later positions are rolled back);
        `extended`: see RaggedBatch.close."""
        _resolve(self, extended)
        store, pool = self.runner.cache, self.runner.pool()
        buffers = [layer.buffers for layer in self.cache.layers]
        extended = self.mask.shape[1] - self.past - self.width  # extend() steps taken
        stored = set()  # a sequence may fill two rows (a proposal and one drafted ahead): the last is kept
        for i, (seq_id, ids, n, salt) in enumerate(zip(self.seq_ids, self.token_ids, keep, self.salts)):
            n = min(n, self.lengths[i])
            r, w, entry = self.reuse[i], self.new_lengths[i], self.entries[i]
            if n <= 0:
                if self.owned[i] and entry is not None:
                    store.free(entry)
                store.drop(seq_id)
                continue
            # (first position, first column, positions) of what this batch computed for the row
            segments = [(r, self.past, min(w, n - r)), (r + w, self.past + self.width, min(extended, n - r - w))]
            if entry is None or seq_id in stored or (not self.owned[i] and store.get(seq_id) is not entry):
                # no table to extend (new, or evicted or released meanwhile): a fresh one, prefix included
                if self.owned[i] and entry is not None:
                    store.free(entry)
                entry = SequenceCache([])
                segments.insert(0, (0, self.past - r, min(n, r)))
            entry.token_ids = entry.token_ids[: r if entry.blocks else 0]
            unchanged = len(entry.token_ids) if not self.owned[i] else 0
            store.reserve(entry, len(entry.token_ids), n, self.protect)
            positions = [p for pos, _, count in segments for p in range(pos, pos + max(count, 0))]
            if positions:  # positions [len(entry), n), in order
                columns = [c for _, col, count in segments for c in range(col, col + max(count, 0))]
                slots = torch.tensor(entry.slots(positions[0], positions[-1] + 1), device=self.runner.device)
                columns = torch.tensor(columns, device=self.runner.device)
                for (k, v), pk, pv in zip(buffers, pool.keys, pool.values):
                    pk.index_copy_(1, slots, k[i].index_select(1, columns))
                    pv.index_copy_(1, slots, v[i].index_select(1, columns))
            entry.token_ids = ids[:n]
            store.put(seq_id, entry, salt, unchanged)
            stored.add(seq_id)
