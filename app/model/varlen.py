"""The varlen attention path's plan and kernel (app/model/ragged.py's "varlen"): a forward's sequences in
groups, each group's contexts gathered end to end from the pool and attended to in one call of
torch's variable-length FlashAttention per layer; on a CPU, where that kernel does not exist, a
reference of its contract."""

import functools
from typing import NamedTuple

import torch

from app.model.memory import VARLEN_GATHER_TOKENS
from app.model.syncs import upload


class Packing(NamedTuple):
    """How one kernel call's sequences lie end to end: the cumulative lengths of their queries and of
    their keys (int32 on the device, n + 1 entries from 0), and the longest of each."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class VarlenGroups:
    """The varlen path's plan for one forward: the spans in groups of consecutive sequences, each
    group's contexts (every position its sequences attend to, in order) gathered from the pool end to
    end, and the kernel's cumulative lengths. Planned on the host from the block tables; its indices
    travel in the forward's one upload (`parts`, then `take`)."""

    def __init__(self, spans: list):  # app.model.ragged.Span: entry, start, length, offset
        # (first span, end span, max queries, max keys, the group's context positions)
        self.groups: list[tuple[int, int, int, int, int]] = []
        self.slots: list[int] = []  # every group's context slots, end to end
        self.cu_q: list[int] = []  # per group: its queries' cumulative lengths from 0 (n + 1 entries)
        self.cu_k: list[int] = []  # per group: its contexts' cumulative lengths from 0
        first = 0
        while first < len(spans):
            end, total = first, 0
            while end < len(spans) and (end == first or total + spans[end].start + spans[end].length
                                        <= VARLEN_GATHER_TOKENS):
                total += spans[end].start + spans[end].length
                end += 1
            group = spans[first:end]
            for s in group:
                self.slots += s.entry.slots(0, s.start + s.length)
            self.cu_q += _cumulative([s.length for s in group])
            self.cu_k += _cumulative([s.start + s.length for s in group])
            self.groups.append((first, end, max(s.length for s in group), max(s.start + s.length for s in group),
                                total))
            first = end
        self.spans = spans
        self._slots = self._cu = None

    def parts(self) -> list[list[int]]:
        """The host lists the forward's one upload carries."""
        return [self.slots, self.cu_q + self.cu_k]

    def take(self, slots: torch.Tensor, cu: torch.Tensor) -> None:
        """Their uploaded tensors (the kernel's lengths as int32, cast on the device)."""
        self._slots, self._cu = slots, cu.to(torch.int32)

    def _uploaded(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._slots is None:  # a forward that was not staged (a test's own Layout): upload here
            self.take(*upload(self.parts(), device))
        return self._slots, self._cu

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """query [1, Hq, T, D] over the pool's keys/values of one layer ([H, slots, D]) -> [1, T, Hq, D];
        rows past the spans' tokens (a compiled step's padding) zero."""
        out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
        if not self.groups:
            return out
        slots, cu = self._uploaded(query.device)
        kernel = varlen_kernel(query.device)
        q_all = query[0].transpose(0, 1)  # [T, Hq, D]
        k_pool, v_pool = keys.transpose(0, 1), values.transpose(0, 1)  # [slots, H, D] views
        at_k = at_cu_q = 0
        at_cu_k = len(self.cu_q)
        for first, end, max_q, max_k, total_k in self.groups:
            n = end - first
            row_a = self.spans[first].offset
            row_b = self.spans[end - 1].offset + self.spans[end - 1].length
            index = slots[at_k : at_k + total_k]
            packing = Packing(cu[at_cu_q : at_cu_q + n + 1], cu[at_cu_k : at_cu_k + n + 1], max_q, max_k)
            out[0, row_a:row_b] = kernel(q_all[row_a:row_b].contiguous(), k_pool.index_select(0, index),
                                         v_pool.index_select(0, index), packing, scale, gqa)
            at_k, at_cu_q, at_cu_k = at_k + total_k, at_cu_q + n + 1, at_cu_k + n + 1
        return out


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def varlen_available() -> bool:
    """Whether this torch has the variable-length FlashAttention (torch.nn.attention.varlen, torch 2.10+)."""
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@functools.lru_cache(maxsize=None)
def varlen_kernel(device: torch.device):
    """The varlen kernel for `device`: torch's FlashAttention varlen on CUDA (causal aligned to the
    bottom right: a sequence's queries are the last of its keys; one KV split, so a sequence's result
    does not depend on its batch), else the reference."""
    if device.type != "cuda":
        return varlen_reference
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "num_splits" in params:
        causal["num_splits"] = 1

    def kernel(q, k, v, packing: Packing, scale: float, gqa: bool) -> torch.Tensor:
        extra = {"enable_gqa": gqa} if "enable_gqa" in params else {}
        if gqa and not extra:  # an older torch without GQA in varlen: the key/value heads repeated
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        return varlen_attn(q, k, v, *packing, scale=scale, **causal, **extra)

    return kernel


def varlen_reference(q, k, v, packing: Packing, scale: float, gqa: bool) -> torch.Tensor:
    """The varlen kernel's contract, one SDPA call per sequence: q [Tq, Hq, D] and k, v [Tk, H, D]
    packed as `packing` says; sequence i's query j sees its keys up to len_k - len_q + j (causal,
    aligned to the bottom right). The CPU's stand-in, for the tests."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = packing.cu_q.tolist(), packing.cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        qa, qb, ka, kb = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if qb == qa:
            continue
        past = (kb - ka) - (qb - qa)  # keys before the first query
        hidden = torch.arange(kb - ka) > torch.arange(past, kb - ka).unsqueeze(1)
        qi = q[qa:qb].transpose(0, 1).unsqueeze(0)
        ki, vi = (t[ka:kb].transpose(0, 1).unsqueeze(0) for t in (k, v))
        out[qa:qb] = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=~hidden.to(q.device), scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
    return out
