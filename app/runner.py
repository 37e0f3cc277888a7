"""ModelRunner: a Hugging Face causal LM with per-sequence KV caches and ragged batched forwards."""

import os
import sys
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from app import dtypes
from app.cpu_linear import pack_linears
from app.grammar import Grammars
from app.kv import KVStore, SequenceCache, common_prefix, grown_capacity
from app.ragged import LAYOUT, Layout, Span, supports_ragged
from app.ragged import NAME as RAGGED
from app.request import tokenizer_eos_ids

def weights_dtype(name_or_path: str, dtype: str, device: str = "cpu", trust_remote_code: bool = False) -> torch.dtype:
    """The dtype to load a checkpoint in for a configured `dtype` on `device` (`app.dtypes.resolve`:
    "auto" is the checkpoint's own where the device computes it natively, else float32)."""
    checkpoint = None
    if dtype == "auto":
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                            local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
        checkpoint = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        checkpoint = getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint
    return dtypes.resolve(dtype, device, checkpoint)


def load_model(
    name_or_path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, object]:
    """Load (model, tokenizer) from a hub id or a local directory; offline when HF_HUB_OFFLINE=1."""
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    kwargs = dict(trust_remote_code=trust_remote_code, local_files_only=offline)
    torch_dtype = weights_dtype(name_or_path, dtype, device, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    return model.to(device).eval().requires_grad_(False), tokenizer


def eos_ids(generation_config, tokenizer) -> frozenset[int]:
    """The ids that end generation, as `generate` and vLLM stop on them: the generation config's (often
    a list on chat models: Llama-3.1-Instruct's <|eom_id|> and <|eot_id|>, Gemma's <end_of_turn>) and
    the tokenizer's own."""
    ids = set(tokenizer_eos_ids(tokenizer))
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids - {None})


def load_generation_config(name_or_path: str, trust_remote_code: bool = False):
    """A checkpoint's generation config, or None where it ships none."""
    try:
        return GenerationConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
    except (OSError, ValueError):
        return None


@dataclass
class SeqInput:
    """One sequence of a batched forward: its full token ids and how many trailing logits it needs."""

    seq_id: str
    token_ids: list[int]
    num_logits: int = 1
    salt: str | None = None  # its request's cache_salt: it borrows only prefixes cached under the same one


class ModelRunner:
    """Runs one model over many sequences at once, reusing each sequence's cached prefix."""

    def __init__(self, model: PreTrainedModel, tokenizer, *, max_cache_bytes: int = 1 << 30, pack: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # embedding rows past the tokenizer's vocabulary are padding: never sampled, sliced off
        self.vocab_size = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = eos_ids(getattr(model, "generation_config", None), tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size)  # structured output's matchers, per sequence
        # a sequence's matcher lives as long as its KV: on a draft replica the release may never come
        self.cache = KVStore(max_cache_bytes, on_drop=self.grammars.release)
        # CPU serving: linears on oneDNN-prepacked weights (app/cpu_linear.py); same maths, 2-3x faster
        self.packed_linears = pack_linears(model) if pack and self.device.type == "cpu" else 0
        # models whose forward takes a per-row mask of the positions to project (transformers'
        # slice_logits_to_keep) run the LM head only where a logit is needed, not over every position
        self.ragged_logits = hasattr(sys.modules.get(type(model).__module__), "slice_logits_to_keep")
        # sequences packed end to end, attention per sequence over its own slab (app/ragged.py); models
        # whose attention that cannot reproduce exactly (sliding windows, soft-capping) use padded batches
        self.ragged = supports_ragged(model)
        if self.ragged:
            model.config._attn_implementation = RAGGED

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        max_cache_bytes: int = 1 << 30, trust_remote_code: bool = False) -> "ModelRunner":
        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, max_cache_bytes=max_cache_bytes, pack=True)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """One batched forward; returns per sequence its last num_logits logits, [num_logits, V] float32."""
        batch = self.open(seqs)
        logits = batch.logits
        batch.close([len(s.token_ids) for s in seqs])
        return logits

    @torch.inference_mode()
    def open(self, seqs: list[SeqInput]) -> "RaggedBatch | Batch":
        """Start a batch: prefill what each sequence lacks; extend() decodes further, close() stores KV."""
        return RaggedBatch(self, seqs) if self.ragged else Batch(self, seqs)

    def release(self, seq_id: str) -> None:
        """A finished or cancelled sequence: its cache stays only as a prefix donor for others."""
        self.cache.retire(seq_id)
        self.grammars.release(seq_id)

    def forget(self, seq_id: str) -> None:
        """Drop a sequence's KV and grammar state outright (a failed forward may have left them half
        written): its next call recomputes both from the token ids it carries. The store's on_drop
        frees the grammar matcher."""
        self.cache.drop(seq_id)


class RaggedBatch:
    """A batch in flight as one packed row (app/ragged.py): no padding, no gather, no write-back.

    Each sequence computes in its own cache slab; positions it no longer needs are forgotten at
    close(). A second row of the same sequence in one batch (its proposal and one drafted ahead)
    computes in a copy of the shared prefix.
    """

    def __init__(self, runner: ModelRunner, seqs: list[SeqInput]):
        self.runner = runner
        self.seq_ids = [s.seq_id for s in seqs]
        self.salts = [s.salt for s in seqs]
        self.token_ids = [list(s.token_ids) for s in seqs]
        self.entries: list[SequenceCache] = []
        spans, ids, offset, used = [], [], 0, set()
        for s in seqs:
            if not 1 <= s.num_logits <= len(s.token_ids):
                raise ValueError(f"num_logits must be in [1, {len(s.token_ids)}], got {s.num_logits}")
            limit = len(s.token_ids) - s.num_logits
            entry = runner.cache.get(s.seq_id)
            borrowed = entry is None and runner.cache.borrow(s.token_ids, limit, s.salt)
            entry = borrowed or entry
            reuse = min(common_prefix(entry.token_ids, s.token_ids), limit) if entry else 0
            if entry is None:
                entry = SequenceCache([], [])
            elif s.seq_id in used and not borrowed:
                entry = entry.copy_prefix(reuse)
            entry.token_ids = entry.token_ids[:reuse]  # forgotten now: a failed forward leaves it valid
            used.add(s.seq_id)
            n = len(s.token_ids) - reuse
            spans.append(Span(entry, reuse, n, offset))
            ids += s.token_ids[reuse:]
            offset += n
            self.entries.append(entry)
        self.lengths = [s.start + s.length for s in spans]  # positions each slab holds after this forward
        self.reuse = [s.start for s in spans]  # positions each sequence reused from its cache
        self.recomputed = offset
        keep = [sp.offset + sp.length - s.num_logits + j for sp, s in zip(spans, seqs) for j in range(s.num_logits)]
        out = self._run(ids, [p for sp in spans for p in range(sp.start, sp.start + sp.length)], Layout(spans), keep)
        self.logits = list(out.split([s.num_logits for s in seqs]))

    def _run(self, ids: list[int], positions: list[int], layout: Layout, keep: list[int]) -> torch.Tensor:
        """One forward of the packed row; returns the logits at `keep` (flat indices), [len(keep), V] float32."""
        device, runner = self.runner.device, self.runner
        index = torch.tensor(keep, device=device)
        extra = {"logits_to_keep": index} if runner.ragged_logits else {}
        out = runner.model(
            input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
            past_key_values=layout, attention_mask=torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device),
            use_cache=True, **{LAYOUT: layout}, **extra,
        ).logits[0]
        return (out if runner.ragged_logits else out[index])[:, : runner.vocab_size].float()

    @torch.inference_mode()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Feed one more token per row; returns next-token logits [B, V] float32."""
        spans = [Span(e, n, 1, i) for i, (e, n) in enumerate(zip(self.entries, self.lengths))]
        for ids, t in zip(self.token_ids, tokens):
            ids.append(t)
        out = self._run(tokens, self.lengths, Layout(spans), list(range(len(tokens))))
        self.lengths = [n + 1 for n in self.lengths]
        return out

    @torch.inference_mode()
    def close(self, keep: list[int]) -> None:
        """Store each row's first keep[i] positions as its cache (later positions are rolled back)."""
        store = self.runner.cache
        for seq_id, ids, entry, n, length, salt in zip(self.seq_ids, self.token_ids, self.entries, keep, self.lengths,
                                                       self.salts):
            n = min(n, length)
            if n <= 0:
                store.drop(seq_id)
                continue
            entry.token_ids = ids[:n]
            store.put(seq_id, entry, salt)


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
    A batch of one computes in its sequence's own slab, copying nothing; a larger batch copies each
    reused prefix in once, and close() writes back only the positions this batch computed.
    """

    def __init__(self, runner: ModelRunner, seqs: list[SeqInput]):
        self.runner = runner
        self.seq_ids = [s.seq_id for s in seqs]
        self.salts = [s.salt for s in seqs]
        self.token_ids = [list(s.token_ids) for s in seqs]
        device = runner.device
        reuse, entries = [], []
        for s in seqs:
            if not 1 <= s.num_logits <= len(s.token_ids):
                raise ValueError(f"num_logits must be in [1, {len(s.token_ids)}], got {s.num_logits}")
            entry = runner.cache.get(s.seq_id) or runner.cache.borrow(s.token_ids, len(s.token_ids) - s.num_logits,
                                                                      s.salt)
            m = common_prefix(entry.token_ids, s.token_ids) if entry else 0
            reuse.append(min(m, len(s.token_ids) - s.num_logits))
            entries.append(entry)
        new = [s.token_ids[r:] for s, r in zip(seqs, reuse)]
        b, past, width = len(seqs), max(reuse), max(len(n) for n in new)

        input_ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, past + width, dtype=torch.long)
        for i, (r, n) in enumerate(zip(reuse, new)):
            input_ids[i, : len(n)] = torch.tensor(n)
            mask[i, past - r : past + len(n)] = 1
        positions = torch.tensor(reuse).unsqueeze(1) + torch.arange(width)  # [B, W]
        self.entries, self.reuse, self.new_lengths, self.past, self.width = entries, reuse, [len(n) for n in new], past, width
        self.in_place = b == 1 and past > 0
        if self.in_place:
            # the row's own slab is the batch buffer: positions past the reused prefix are overwritten,
            # so the stored entry forgets them now (an exception mid-forward leaves it valid)
            entries[0].token_ids = entries[0].token_ids[:past]
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
        if keep is not None:  # out: [sum(num_logits), V], row-major
            self.logits = list(out[:, :v].float().split([s.num_logits for s in seqs]))
        else:
            self.logits = [out[i, len(n) - s.num_logits : len(n), :v].float() for i, (n, s) in enumerate(zip(new, seqs))]

    def _gather(self, entries, reuse: list[int], past: int, width: int) -> list[_SlabLayer]:
        """Per layer a buffer [B, H, past + width + ROOM, D] with each reused prefix left-padded to `past`."""
        ref = next(e for e, r in zip(entries, reuse) if r)
        if self.in_place:
            return [_SlabLayer(k.unsqueeze(0), v.unsqueeze(0), past) for k, v in ref.slabs]
        cap = past + width + ROOM
        layers = []
        for layer in range(len(ref.slabs)):
            k0, v0 = ref.slabs[layer]
            keys = k0.new_empty(len(entries), k0.shape[0], cap, k0.shape[2])
            values = v0.new_empty(len(entries), v0.shape[0], cap, v0.shape[2])
            for i, (e, r) in enumerate(zip(entries, reuse)):
                pad = past - r
                keys[i, :, :pad] = 0  # masked out, but must be finite: 0 x NaN would poison the softmax
                values[i, :, :pad] = 0
                if r:
                    keys[i, :, pad:past] = e.slabs[layer][0][:, :r]
                    values[i, :, pad:past] = e.slabs[layer][1][:, :r]
            layers.append(_SlabLayer(keys, values, past))
        return layers

    def _run(self, input_ids, positions, cache_position, keep: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if keep is None else {"logits_to_keep": keep}
        out = self.runner.model(
            input_ids=input_ids, attention_mask=None if self.aligned else self.mask, position_ids=positions,
            past_key_values=self.cache, cache_position=cache_position, use_cache=True, **extra,
        )
        return out.logits

    @torch.inference_mode()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Feed one more token per row; returns next-token logits [B, V] float32."""
        device = self.runner.device
        for ids, t in zip(self.token_ids, tokens):
            ids.append(t)
        positions = torch.tensor(self.lengths, device=device).unsqueeze(1)
        self.lengths = [n + 1 for n in self.lengths]
        width = self.mask.shape[1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        ids = torch.tensor(tokens, device=device).unsqueeze(1)
        out = self._run(ids, positions, torch.tensor([width], device=device))
        return out[:, -1, : self.runner.vocab_size].float()

    @torch.inference_mode()
    def close(self, keep: list[int]) -> None:
        """Store each row's first keep[i] positions as its cache (later positions are rolled back)."""
        store = self.runner.cache
        buffers = [layer.buffers for layer in self.cache.layers]
        extended = self.mask.shape[1] - self.past - self.width  # extend() steps taken
        stored = set()  # a sequence may fill two rows (a proposal and one drafted ahead): one slab each
        for i, (seq_id, ids, n, salt) in enumerate(zip(self.seq_ids, self.token_ids, keep, self.salts)):
            n = min(n, self.lengths[i])
            if n <= 0:
                store.drop(seq_id)
                continue
            if self.in_place or (len(self.seq_ids) == 1 and self.past == 0):  # the buffer is this row's alone
                store.put(seq_id, SequenceCache(ids[:n], [(k[0], v[0]) for k, v in buffers]), salt)
                continue
            r, w = self.reuse[i], self.new_lengths[i]
            entry = self.entries[i]
            if entry is None or store.get(seq_id) is not entry or r == 0 or seq_id in stored:
                # no slab to extend (new, evicted or released meanwhile): a fresh one, prefix included
                entry = self._fresh_entry(buffers, n)
                segments = [(0, self.past - r, min(n, r))] if r else []
            else:
                entry.token_ids = entry.token_ids[:r]
                entry.reserve(n)
                segments = []
            # (first position, first column, positions) of what this batch computed for the row
            segments += [(r, self.past, min(w, n - r)), (r + w, self.past + self.width, min(extended, n - r - w))]
            for (k, v), (ks, vs) in zip(buffers, entry.slabs):
                for pos, col, count in segments:
                    if count > 0:
                        ks[:, pos : pos + count] = k[i, :, col : col + count]
                        vs[:, pos : pos + count] = v[i, :, col : col + count]
            entry.token_ids = ids[:n]
            store.put(seq_id, entry, salt)
            stored.add(seq_id)

    @staticmethod
    def _fresh_entry(buffers, n: int) -> SequenceCache:
        cap = grown_capacity(n)
        return SequenceCache([], [(k.new_empty(k.shape[1], cap, k.shape[3]), v.new_empty(v.shape[1], cap, v.shape[3]))
                                  for k, v in buffers])
