"""Ragged forwards: every sequence's new tokens end to end in one [1, T] row, attention per sequence.

A batch of verify rows (K+1 tokens each), draft steps (1 each) and prompts (hundreds) runs as one
forward over T = the sum of their new tokens: the linears, norms and MLPs see no padding, and
attention reads each sequence's keys and values from the blocks that hold its KV cache (app/kv.py),
in place where they are one run of the pool. Nothing is gathered into a padded batch and nothing is
copied back: a forward writes every sequence's new positions straight into their blocks, one indexed
copy per layer, and a rollback is a length change.

This is the varlen layout of transformers' own continuous batching (tokens packed, attention told
where each sequence starts); its paged cache is built around its own scheduler, so here the
layout is carried by a registered attention function over our block pool. The model's
forward is Hugging Face's, unchanged.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from app.kv import BlockPool, SequenceCache

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
    runs: list[tuple[int, int]] | None = None  # the slots of its positions [0, end), as runs of the pool
    gather: torch.Tensor | None = None  # those slots as one index, when they are more than one run

    def causal_mask(self, device: torch.device) -> torch.Tensor | None:
        """Query j (absolute position start + j) sees keys 0..start + j: causal, offset by what was
        cached. None for one query, which sees every key. The same for every layer: built once."""
        if self.length > 1 and self.mask is None:
            end = self.start + self.length
            self.mask = torch.arange(end, device=device) <= torch.arange(self.start, end, device=device).unsqueeze(1)
        return self.mask


class Layout:
    """The packed row's sequences; the model's cache for one forward: it writes every sequence's new
    keys and values into their blocks with one indexed copy per layer, and attention reads them there."""

    def __init__(self, spans: list[Span], pool: BlockPool):
        self.spans, self.pool = spans, pool
        device = pool.keys[0].device
        self.slots = torch.tensor([slot for s in spans for slot in s.entry.slots(s.start, s.start + s.length)],
                                  device=device)
        for s in spans:
            s.runs = s.entry.runs(s.start + s.length)
            if len(s.runs) > 1:
                s.gather = torch.tensor(s.entry.slots(0, s.start + s.length), device=device)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the packed new keys/values ([1, H, T, D]) into the pool at their slots."""
        self.pool.keys[layer_idx].index_copy_(1, self.slots, keys[0])
        self.pool.values[layer_idx].index_copy_(1, self.slots, values[0])
        return keys, values

    def kv(self, s: Span, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A span's keys and values of every position it attends to, [1, H, end, D]: read in place when
        its blocks are one run of the pool, else gathered."""
        k, v = self.pool.keys[layer], self.pool.values[layer]
        if s.gather is None:
            a, b = s.runs[0]
            return k[:, a:b].unsqueeze(0), v[:, a:b].unsqueeze(0)
        return k.index_select(1, s.gather).unsqueeze(0), v.index_select(1, s.gather).unsqueeze(0)


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
        k, v = layout.kv(s, layer)
        q = query[:, :, s.offset : s.offset + s.length]  # [1, Hq, n, D]
        out[:, :, s.offset : s.offset + s.length] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=s.causal_mask(q.device), scale=scaling, enable_gqa=gqa)
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
