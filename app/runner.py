"""ModelRunner: a Hugging Face causal LM with per-sequence KV caches and ragged batched forwards."""

import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from app.kv import KVStore, SequenceCache, common_prefix

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    name_or_path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, object]:
    """Load (model, tokenizer) from a hub id or a local directory; offline when HF_HUB_OFFLINE=1."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    kwargs = dict(trust_remote_code=trust_remote_code, local_files_only=offline)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], **kwargs)
    return model.to(device).eval().requires_grad_(False), tokenizer


@dataclass
class SeqInput:
    """One sequence of a batched forward: its full token ids and how many trailing logits it needs."""

    seq_id: str
    token_ids: list[int]
    num_logits: int = 1


class ModelRunner:
    """Runs one model over many sequences at once, reusing each sequence's cached prefix."""

    def __init__(self, model: PreTrainedModel, tokenizer, *, max_cache_bytes: int = 1 << 30):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # embedding rows past the tokenizer's vocabulary are padding: never sampled, sliced off
        self.vocab_size = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])
        self.max_context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.cache = KVStore(max_cache_bytes)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        max_cache_bytes: int = 1 << 30, trust_remote_code: bool = False) -> "ModelRunner":
        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, max_cache_bytes=max_cache_bytes)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """One batched forward; returns per sequence its last num_logits logits, [num_logits, V] float32."""
        batch = self.open(seqs)
        logits = batch.logits
        batch.close([len(s.token_ids) for s in seqs])
        return logits

    @torch.inference_mode()
    def open(self, seqs: list[SeqInput]) -> "Batch":
        """Start a batch: prefill what each sequence lacks; extend() decodes further, close() stores KV."""
        return Batch(self, seqs)

    def release(self, seq_id: str) -> None:
        """Free a finished or cancelled sequence's cache."""
        self.cache.drop(seq_id)


def _dynamic_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache over these (keys, values) without copying them (its constructor would)."""
    cache = DynamicCache()
    for k, v in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


class Batch:
    """A ragged batch in flight: per-sequence caches gathered into one padded DynamicCache.

    Layout of row i in the KV axis: [left pad | reused prefix | new tokens | right pad | extended...];
    pads are masked out and positions are explicit, so every row sees exactly its own sequence.
    When no row needs padding (always at batch 1) the mask is dropped: the model's causal fast path.
    """

    def __init__(self, runner: ModelRunner, seqs: list[SeqInput]):
        self.runner = runner
        self.seq_ids = [s.seq_id for s in seqs]
        self.token_ids = [list(s.token_ids) for s in seqs]
        device = runner.device
        reuse, entries = [], []
        for s in seqs:
            if not 1 <= s.num_logits <= len(s.token_ids):
                raise ValueError(f"num_logits must be in [1, {len(s.token_ids)}], got {s.num_logits}")
            entry = runner.cache.get(s.seq_id)
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
        cache = _dynamic_cache(self._gather(entries, reuse, past)) if past else DynamicCache()
        self.aligned = bool(mask.all())
        self.cache, self.mask = cache, mask.to(device)
        self.lengths = [r + len(n) for r, n in zip(reuse, new)]
        self.recomputed = sum(len(n) for n in new)
        out = self._run(input_ids.to(device), positions.to(device), torch.arange(past, past + width, device=device))
        v = runner.vocab_size
        self.logits = [out[i, len(n) - s.num_logits : len(n), :v].float() for i, (n, s) in enumerate(zip(new, seqs))]

    def _gather(self, entries, reuse: list[int], past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Left-pad each reused prefix to `past`: per layer (keys, values) of [B, H, past, D]."""
        ref = next(e for e, r in zip(entries, reuse) if r)
        if len(entries) == 1:  # a batch of one: the stored tensors themselves, no copy
            return [(k[:, :past].unsqueeze(0), v[:, :past].unsqueeze(0)) for k, v in ref.layers]
        layers = []
        for layer in range(len(ref.layers)):
            k0 = ref.layers[layer][0]
            keys = k0.new_zeros(len(entries), k0.shape[0], past, k0.shape[2])
            values = torch.zeros_like(keys)
            for i, (e, r) in enumerate(zip(entries, reuse)):
                if r:
                    keys[i, :, past - r :] = e.layers[layer][0][:, :r]
                    values[i, :, past - r :] = e.layers[layer][1][:, :r]
            layers.append((keys, values))
        return layers

    def _run(self, input_ids, positions, cache_position) -> torch.Tensor:
        out = self.runner.model(
            input_ids=input_ids, attention_mask=None if self.aligned else self.mask, position_ids=positions,
            past_key_values=self.cache, cache_position=cache_position, use_cache=True,
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
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        for i, (seq_id, ids, n) in enumerate(zip(self.seq_ids, self.token_ids, keep)):
            n = min(n, self.lengths[i])
            if n <= 0:
                self.runner.cache.drop(seq_id)
                continue
            if self.aligned:  # no pads: the row's first n positions (a view when the batch is this row alone)
                own = len(self.seq_ids) == 1
                kv = [(k[i, :, :n] if own else k[i, :, :n].clone(), v[i, :, :n] if own else v[i, :, :n].clone())
                      for k, v in layers]
            else:
                idx = self.mask[i].nonzero().squeeze(-1)[:n]
                kv = [(k[i].index_select(1, idx), v[i].index_select(1, idx)) for k, v in layers]
            self.runner.cache.put(seq_id, SequenceCache(ids[:n], kv))
