"""Ragged forwards: every sequence's new tokens end to end in one [1, T] row, attention per sequence.

A batch of verify rows (K+1 tokens each), draft steps (1 each) and prompts (hundreds) runs as one
forward over T = the sum of their new tokens: the linears, norms and MLPs see no padding, and
attention reads each sequence's keys and values in place, from the slab that holds its KV cache
(app/kv.py). Nothing is gathered into a padded batch and nothing is copied back: a forward writes
each sequence's new positions straight into its slab, and a rollback forgets positions.

This is the varlen layout of transformers' own continuous batching (tokens packed, attention told
where each sequence starts); its paged cache is built around its own scheduler, so here the
layout is carried by a registered attention function over our per-sequence slabs. The model's
forward is Hugging Face's, unchanged.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from app.kv import SequenceCache, grown_capacity

NAME = "specserve_ragged"
LAYOUT = "specserve_layout"  # the forward's keyword argument carrying the Layout to the attention function


@dataclass
class Span:
    """One sequence in a ragged forward: its cache, where its new tokens start in it and in the row."""

    entry: SequenceCache
    start: int  # absolute position of its first new token (= positions already cached)
    length: int  # new tokens
    offset: int  # index of its first new token in the packed row
    mask: torch.Tensor | None = None  # its causal mask, built by the first layer that needs it

    def causal_mask(self, device: torch.device) -> torch.Tensor | None:
        """Query j (absolute position start + j) sees keys 0..start + j: causal, offset by what was
        cached. None for one query, which sees every key. The same for every layer: built once."""
        if self.length > 1 and self.mask is None:
            end = self.start + self.length
            self.mask = torch.arange(end, device=device) <= torch.arange(self.start, end, device=device).unsqueeze(1)
        return self.mask


class Layout:
    """The packed row's sequences; the model's cache for one forward (it writes into their slabs)."""

    def __init__(self, spans: list[Span]):
        self.spans = spans

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write each sequence's new keys/values ([1, H, T, D], packed) into its slab at its positions."""
        for s in self.spans:
            k, v = _slab(s.entry, layer_idx, keys, values, s.start + s.length)
            k[:, s.start : s.start + s.length] = keys[0, :, s.offset : s.offset + s.length]
            v[:, s.start : s.start + s.length] = values[0, :, s.offset : s.offset + s.length]
        return keys, values


def _slab(entry: SequenceCache, layer: int, keys: torch.Tensor, values: torch.Tensor, need: int):
    """The entry's (keys, values) slab of `layer`, allocated or grown to hold `need` positions."""
    while len(entry.slabs) <= layer:  # a new sequence: slabs appear layer by layer in the first forward
        cap = grown_capacity(need)
        entry.slabs.append((keys.new_empty(keys.shape[1], cap, keys.shape[3]),
                            values.new_empty(values.shape[1], cap, values.shape[3])))
    k, v = entry.slabs[layer]
    if need > k.shape[1]:  # full: grow by a quarter (amortised), keeping what it holds
        cap = grown_capacity(need)
        k2, v2 = k.new_empty(k.shape[0], cap, k.shape[2]), v.new_empty(v.shape[0], cap, v.shape[2])
        k2[:, : k.shape[1]], v2[:, : v.shape[1]] = k, v
        entry.slabs[layer] = k, v = k2, v2
    return k, v


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Attention of each sequence's queries over its own cached keys/values. query: [1, Hq, T, D] ->
    [1, T, Hq, D]. Without a layout (a plain Hugging Face call, e.g. generate) it is SDPA."""
    layout: Layout | None = kwargs.pop(LAYOUT, None)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.empty_like(query)
    layer = module.layer_idx
    gqa = query.shape[1] != key.shape[1]
    for s in layout.spans:
        end = s.start + s.length
        k, v = s.entry.slabs[layer]
        q = query[:, :, s.offset : s.offset + s.length]  # [1, Hq, n, D]
        out[:, :, s.offset : s.offset + s.length] = torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :end].unsqueeze(0), v[:, :end].unsqueeze(0), attn_mask=s.causal_mask(q.device), scale=scaling,
            enable_gqa=gqa)
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, ragged_attention)
# plain calls (generate, tests' references) keep SDPA's masks
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def supports_ragged(model) -> bool:
    """Whether ragged attention computes exactly what the model's own attention does: full causal
    attention with standard scaling (no sliding windows, no logit soft-capping)."""
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "use_sliding_window", False):
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    return getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager", NAME)
