"""Ragged forwards: every sequence's new tokens end to end in one [1, T] row, attention per sequence.

A batch of verify rows (K+1 tokens each), draft steps (1 each) and prompts (hundreds) runs as one
forward over T = the sum of their new tokens: the linears, norms and MLPs see no padding, and
attention reads each sequence's keys and values from the blocks that hold its KV cache (app/model/kv.py),
in place where they are one run of the pool. Nothing is gathered into a padded batch and nothing is
copied back: a forward writes every sequence's new positions straight into their blocks, one indexed
copy per layer, and a rollback is a length change.

This is the varlen layout of transformers' own continuous batching (tokens packed, attention told
where each sequence starts); its paged cache is built around its own scheduler, so here the
layout is carried by a registered attention function over our block pool. The model's
forward is Hugging Face's, unchanged.

Attention, the write of new keys and values included, is one custom torch op per layer
(`specserve::ragged_attention`): a compiled step (app/model/compiled.py) traces the model around it
as an opaque call, so the graph has no break and no shape that depends on the batch's
composition. The op reads the forward's Layout from the thread that runs it (`active()`): a
compiled graph's inputs are tensors, not Python objects. It is tagged unsafe for CUDA graphs, so a
captured step (mode "reduce-overhead") replays the kernels around it and calls it live.

Inside the op, attention takes one of three paths (`ModelRunner(attention=...)`):
- "flex" (opt-in): one FlexAttention call per layer over the whole pool, with a block mask
  built once per forward from the block tables: no per-sequence calls, no dense mask, no gather.
- "cpu_paged" (auto on a CPU that can build it): every span (decode steps, verify rows, prompt chunks)
  in one call per layer of a small C++ kernel reading each row's keys through its block table
  (app/model/cpu_attention.py). Each row computes alone, in one order, so a position's keys, values and
  logits are the same bits however its sequence was chunked, batched or borrowed from the prefix cache
  (SDPA's blocking depends on the call's shape: docs/architecture.md, "Batch invariance").
- "per_sequence": one SDPA call per sequence over its blocks in place.
- "varlen" (auto on CUDA for float16 and bfloat16 models): torch's variable-length FlashAttention
  (`torch.nn.attention.varlen`), one call per layer for a group of sequences whose contexts are
  gathered end to end (at most VARLEN_GATHER_TOKENS positions a group, so the gather's memory is
  bounded whatever the batch): a batch of 32 decode steps takes a few kernels a layer where
  per_sequence takes 32 SDPA calls and their masks (on an H200, a 5-row verify of 32 sequences
  12.1 ms against 28.5: docs/configuration.md, the third GPU run). The kernel's paged form (a block table into the pool)
  needs pages of 128-256 positions (BLOCK_SIZE is 16), hence the gather (app/model/varlen.py). On a CPU,
  where the kernel does not run, a reference of its contract (`varlen_reference`) stands in, so the
  tests check the packing.
All run on a CPU, and the tests check each (specserve/bench/kv.py measures them).
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.model import cpu_attention, sessions
from app.model.kv import BLOCK_SIZE, BlockPool, SequenceCache
from app.model.syncs import upload
from app.model.varlen import VarlenGroups

NAME = "specserve_ragged"
LAYOUT = "specserve_layout"  # the forward's keyword argument saying it runs over the active Layout
# LAYOUT's value when the layers are one compiled graph (app/model/compiled.py, per_layer): attention
# takes the layers in the order they run, not each one's index, which the graph would hold as a constant
IN_ORDER = "layers in order"


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
            keys, queries = torch.arange(end, device=like.device), torch.arange(self.start, end, device=like.device)
            hidden = keys > queries.unsqueeze(1)
            self.mask = torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(hidden, -torch.inf)
        return self.mask


class Layout:
    """The packed row's sequences; the model's cache for one forward: it writes every sequence's new
    keys and values into their blocks with one indexed copy per layer (or the CPU kernel writes them in
    its call, where it computes every span), and attention reads them there.

    attention: "flex", "cpu_paged", "per_sequence" or "varlen" (the module's docstring)."""

    def __init__(self, spans: list[Span], pool: BlockPool, attention: str = "per_sequence"):
        self.spans, self.pool = spans, pool
        self.flex = attention == "flex"
        self.varlen = VarlenGroups(spans) if attention == "varlen" else None
        self._mask = None  # (padded row length, BlockMask) of the flex path, built by the first layer
        device = pool.keys[0].device
        # the pool slots of the row's new positions: uploaded with the forward's other indices (Batch._run)
        self.slot_list = [slot for s in spans for slot in s.entry.slots(s.start, s.start + s.length)]
        self._slots = None
        # the CPU kernel computes every span (steps, verify rows, prompt chunks) in one call per layer: each row
        # alone, so a position's bits do not depend on how its sequence was chunked or batched
        self.paged = cpu_attention.Spans(spans, every=True) if attention == "cpu_paged" and spans else None
        # the spans torch's SDPA computes, one call each (the flex path reads the pool through its mask)
        self.sdpa = [] if self.flex or self.varlen or self.paged else spans
        for s in self.sdpa:
            s.runs = s.entry.runs(s.start + s.length)
        # the spans whose tables are in several runs: their slots gathered, the indices in the forward's
        # one upload (`parts`, `take`); an upload of its own per span synchronised a GPU's stream
        self.gathered = [s for s in self.sdpa if len(s.runs) > 1]
        self._device, self._taken = device, False
        self._next_layer = 0  # IN_ORDER: the layer whose attention runs next (a forward runs them all, in order)

    def next_layer(self) -> int:
        layer = self._next_layer
        self._next_layer = (layer + 1) % len(self.pool.keys)
        return layer

    def parts(self) -> list[list[int]]:
        """Host lists of indices this layout's attention needs beyond the row's slots, for the forward's
        one upload: the gathered spans' slots, end to end, then the varlen plan's."""
        return [[x for s in self.gathered for x in s.entry.slots(0, s.start + s.length)]] + (
            self.varlen.parts() if self.varlen else [])

    def take(self, staged: list[torch.Tensor]) -> None:
        """The uploaded `parts()`, in their order."""
        self._taken = True
        if self.gathered:
            for s, index in zip(self.gathered, staged[0].split([s.start + s.length for s in self.gathered])):
                s.gather = index
        if self.varlen:
            self.varlen.take(*staged[1:3])

    def _staged(self) -> None:
        """A layout no forward staged (warm-up's, a test's own): its parts uploaded here, once."""
        if not self._taken:
            self.take(upload(self.parts(), self._device))

    @property
    def slots(self) -> torch.Tensor:
        if self._slots is None:
            self._slots = torch.tensor(self.slot_list, dtype=torch.long, device=self.pool.keys[0].device)
        return self._slots

    @slots.setter
    def slots(self, value: torch.Tensor) -> None:
        self._slots = value

    def write(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
        """Write the packed new keys/values ([1, H, T', D], T' >= T: a compiled step pads the row) into
        the pool at their slots."""
        n = self.slots.numel()
        self.pool.keys[layer].index_copy_(1, self.slots, keys[0, :, :n])
        self.pool.values[layer].index_copy_(1, self.slots, values[0, :, :n])

    def block_mask(self, rows: int):
        """The flex path's mask over (row position, pool slot): a query of sequence i at absolute
        position p sees slot x when x's block is in i's table at index j and j * BLOCK_SIZE + x % BLOCK_SIZE
        <= p. Padding rows (past the layout's tokens) see nothing. Built once per forward, before it runs
        (ModelRunner: a compiled step's op cannot build it)."""
        if self._mask is not None and self._mask[0] == rows:
            return self._mask[1]
        from torch.nn.attention.flex_attention import create_block_mask

        device, n_blocks = self.slots.device, self.pool.num_blocks
        seq = torch.full((rows,), -1, dtype=torch.long, device=device)  # the row's sequence, -1: padding
        pos = torch.zeros(rows, dtype=torch.long, device=device)  # the row's absolute position
        logical = torch.full((max(1, len(self.spans)), n_blocks), -1, dtype=torch.long, device=device)
        for i, s in enumerate(self.spans):
            seq[s.offset : s.offset + s.length] = i
            pos[s.offset : s.offset + s.length] = torch.arange(s.start, s.start + s.length, device=device)
            table = s.entry.blocks[: -(-(s.start + s.length) // BLOCK_SIZE)]
            logical[i, torch.tensor(table, dtype=torch.long, device=device)] = torch.arange(len(table), device=device)

        def visible(b, h, q, kv):
            i = seq[q]
            j = logical[i.clamp(min=0), kv // BLOCK_SIZE]
            return (i >= 0) & (j >= 0) & (j * BLOCK_SIZE + kv % BLOCK_SIZE <= pos[q])

        # compiled on a GPU: the eager builder materialises rows x pool slots booleans
        mask = create_block_mask(visible, None, None, rows, n_blocks * BLOCK_SIZE, device=device,
                                 _compile=device.type == "cuda")
        self._mask = (rows, mask)
        return mask

    def kv(self, s: Span, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A span's keys and values of every position it attends to, [1, H, end, D]: read in place when
        its blocks are one run of the pool, else gathered."""
        k, v = self.pool.keys[layer], self.pool.values[layer]
        if len(s.runs) == 1:
            a, b = s.runs[0]
            return k[:, a:b].unsqueeze(0), v[:, a:b].unsqueeze(0)
        self._staged()
        return k.index_select(1, s.gather).unsqueeze(0), v.index_select(1, s.gather).unsqueeze(0)


_local = threading.local()  # the Layout of the forward this thread runs


def flex_attention(query, key, value, **kwargs):
    """torch's FlexAttention, compiled on first use on a GPU (its fused kernel); eager elsewhere, where
    it runs torch's reference implementation (the CPU tests' path: exact, not fast).

    Called from a compiled step, this op's kernel runs with every dispatch key above the backend
    excluded (AOTAutograd's runtime), and FlexAttention, a higher-order op, needs them to dispatch:
    the thread's ordinary key sets are restored around it."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention as flex

    sessions.install(dynamo=True)  # its first call compiles, inside a forward (app/model/sessions.py)
    if query.device.type == "cuda":
        _flex_compiled = _flex_compiled or torch.compile(flex, dynamic=False)
        flex = _flex_compiled
    with torch._C._ForceDispatchKeyGuard(_INCLUDE, _EXCLUDE):
        return flex(query, key, value, **kwargs)


_flex_compiled = None
_INCLUDE, _EXCLUDE = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


@contextmanager
def active(layout: Layout):
    """Run a forward over `layout`: the attention op of every layer reads it."""
    before = getattr(_local, "layout", None)
    _local.layout = layout
    _bind(layout)
    try:
        yield layout
    finally:
        _local.layout = before
        _bind(before)


def _bind(layout: "Layout | None") -> None:
    """The C++ CPU kernel's view of the forward (app/model/cpu_attention.py bind): its paged spans, where they are all of it."""
    cpu_attention.bind(layout.paged if layout is not None else None, layout.pool if layout is not None else None)


# Defined through torch.library.Library rather than torch.library.custom_op: a step calls it once per
# layer, and custom_op's wrappers cost about 20 us a call against 5 (measured, 2-core EPYC).
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
# `layer`: the layer's index, or -1 for the next in order (IN_ORDER)
_LIBRARY.define("ragged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """One layer's attention over the active Layout: write the row's new keys and values into the pool,
    then each sequence's queries over its own cached keys/values. query: [1, Hq, T, D] -> [1, T, Hq, D];
    rows past the layout's tokens (a compiled step's padding) come out zero."""
    layout: Layout = _local.layout
    if layer < 0:  # IN_ORDER
        layer = layout.next_layer()
    # the CPU kernel writes the new keys and values itself where it computes every span
    fused = layout.paged is not None and layout.paged.every and key.dtype == layout.pool.keys[layer].dtype
    if not fused:
        layout.write(key, value, layer)
    gqa = query.shape[1] != key.shape[1]
    if layout.varlen:
        return layout.varlen.attend(query, layout.pool.keys[layer], layout.pool.values[layer], scale, gqa)
    if layout.flex:
        k, v = layout.pool.keys[layer].unsqueeze(0), layout.pool.values[layer].unsqueeze(0)  # [1, H, slots, D]
        out = flex_attention(query, k, v, block_mask=layout.block_mask(query.shape[2]), scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [1, T, Hq, D]
    if layout.paged:
        layout.paged.attend(query, layout.pool.keys[layer], layout.pool.values[layer], out, scale,
                            (key, value) if fused else None)
    for s in layout.sdpa:
        k, v = layout.kv(s, layer)
        q = query[:, :, s.offset : s.offset + s.length]  # [1, Hq, n, D]
        out[:, s.offset : s.offset + s.length] = sdpa(q, k, v, s.causal_mask(q), scale, gqa,
                                                      fused_only=q.device.type == "cuda").transpose(1, 2)
    return out


def shape_free_sdpa() -> None:
    """Keep SDPA off cuDNN's attention, for the process: per-sequence calls meet a new (queries, keys)
    shape nearly every call (each sequence's context grows every round), and cuDNN builds an
    execution plan for each shape it has not seen. On an H200 (torch 2.11) cuDNN was SDPA's choice, and
    a batch of 32 requests took 31-38 s for 16 tokens, 74 % of its samples in the SDPA call; FlashAttention
    and the memory-efficient kernel take any shape as it comes. The flag is the process's, as are all of
    torch's SDPA backend flags (app/model/ragged.py sdpa): a GPU replica runs one model per process."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def sdpa(query, key, value, mask, scale: float, gqa: bool, fused_only: bool = False) -> torch.Tensor:
    """torch's SDPA over one sequence. fused_only (on a GPU): keys and values repeated to the query
    heads, so that a masked call can take the memory-efficient kernel, which holds no [heads,
    queries, keys] scores: with enable_gqa a masked call on a GPU has only the math kernel, whose
    scores at a 131k context need gigabytes the memory model does not give it (app/model/memory.py).
    The kernels are not restricted with torch's sdpa_kernel: its flags are the process's, not the
    thread's, and on the first GPU run a restriction held by one forward thread failed another
    thread's plain float32 call ("No available kernel")."""
    if fused_only and gqa:
        groups = query.shape[1] // key.shape[1]
        key, value, gqa = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), False
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=gqa)


_LIBRARY.impl("ragged_attention", attend, "CompositeExplicitAutograd")
# the same body under a name of its own: what the op's C++ CPU kernel calls for a forward it was not bound to
_LIBRARY.define("ragged_attention_python(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))
_LIBRARY.impl("ragged_attention_python", attend, "CompositeExplicitAutograd")


@torch.library.register_fake("specserve::ragged_attention")
def _(query, key, value, layer, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The model's attention function: the ragged op when the forward runs over a Layout (its
    keyword LAYOUT is set), SDPA otherwise (a plain Hugging Face call, e.g. generate)."""
    layout = kwargs.pop(LAYOUT, False)
    if not layout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = -1 if layout == IN_ORDER else module.layer_idx
    return torch.ops.specserve.ragged_attention(query, key, value, layer, scale), None


def register() -> None:
    """Make NAME one of transformers' attention implementations (again: a no-op). Called where a model
    is given to a runner, not at import: transformers' attention and mask registries live in its modeling
    stack, seconds of CPU to import in a process that loads no model (the app's build)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

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
