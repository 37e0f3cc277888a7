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

Attention, the write of new keys and values included, is one custom torch op per layer
(`specserve::ragged_attention`): a compiled step (app/compiled.py) traces the model around it
as an opaque call, so the graph has no break and no shape that depends on the batch's
composition. The op reads the forward's Layout from the thread that runs it (`active()`): a
compiled graph's inputs are tensors, not Python objects. It is tagged unsafe for CUDA graphs, so a
captured step (mode "reduce-overhead") replays the kernels around it and calls it live.
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from app.kv import BlockPool, SequenceCache

NAME = "specserve_ragged"
LAYOUT = "specserve_layout"  # the forward's keyword argument saying it runs over the active Layout


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

    def causal_mask(self, like: torch.Tensor) -> torch.Tensor | None:
        """Query j (absolute position start + j) sees keys 0..start + j: causal, offset by what was
        cached. None for one query, which sees every key. Additive, in the queries' dtype (SDPA converts a
        boolean mask at every call: 18 against 21 us a call, 5 queries x 305 keys on a CPU); the same for
        every layer: built once."""
        if self.length > 1 and self.mask is None:
            end = self.start + self.length
            hidden = torch.arange(end, device=like.device) > torch.arange(self.start, end, device=like.device).unsqueeze(1)
            self.mask = torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))
        return self.mask


class Layout:
    """The packed row's sequences; the model's cache for one forward: it writes every sequence's new
    keys and values into their blocks with one indexed copy per layer, and attention reads them there."""

    def __init__(self, spans: list[Span], pool: BlockPool):
        self.spans, self.pool = spans, pool
        device = pool.keys[0].device
        self.slots = torch.tensor([slot for s in spans for slot in s.entry.slots(s.start, s.start + s.length)],
                                  dtype=torch.long, device=device)
        for s in spans:
            s.runs = s.entry.runs(s.start + s.length)
            if len(s.runs) > 1:
                s.gather = torch.tensor(s.entry.slots(0, s.start + s.length), device=device)

    def write(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
        """Write the packed new keys/values ([1, H, T', D], T' >= T: a compiled step pads the row) into
        the pool at their slots."""
        n = self.slots.numel()
        self.pool.keys[layer].index_copy_(1, self.slots, keys[0, :, :n])
        self.pool.values[layer].index_copy_(1, self.slots, values[0, :, :n])

    def kv(self, s: Span, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A span's keys and values of every position it attends to, [1, H, end, D]: read in place when
        its blocks are one run of the pool, else gathered."""
        k, v = self.pool.keys[layer], self.pool.values[layer]
        if s.gather is None:
            a, b = s.runs[0]
            return k[:, a:b].unsqueeze(0), v[:, a:b].unsqueeze(0)
        return k.index_select(1, s.gather).unsqueeze(0), v.index_select(1, s.gather).unsqueeze(0)


_local = threading.local()  # the Layout of the forward this thread runs


@contextmanager
def active(layout: Layout):
    """Run a forward over `layout`: the attention op of every layer reads it."""
    before = getattr(_local, "layout", None)
    _local.layout = layout
    try:
        yield layout
    finally:
        _local.layout = before


@torch.library.custom_op("specserve::ragged_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """One layer's attention over the active Layout: write the row's new keys and values into the pool,
    then each sequence's queries over its own cached keys/values. query: [1, Hq, T, D] -> [1, T, Hq, D];
    rows past the layout's tokens (a compiled step's padding) come out zero."""
    layout: Layout = _local.layout
    layout.write(key, value, layer)
    out = torch.zeros_like(query)
    gqa = query.shape[1] != key.shape[1]
    for s in layout.spans:
        k, v = layout.kv(s, layer)
        q = query[:, :, s.offset : s.offset + s.length]  # [1, Hq, n, D]
        out[:, :, s.offset : s.offset + s.length] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=s.causal_mask(q), scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


@attend.register_fake
def _(query, key, value, layer, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The model's attention function: the ragged op when the forward runs over a Layout (its
    keyword LAYOUT is set), SDPA otherwise (a plain Hugging Face call, e.g. generate)."""
    if not kwargs.pop(LAYOUT, False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.specserve.ragged_attention(query, key, value, module.layer_idx, scale), None


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
