"""How much KV cache a replica (or a tensor-parallel rank) may hold, from its device's memory.

On a GPU the budget is what is left of `utilization` × the device's memory once the weights are
loaded (and whatever else already holds memory on it), less the working buffers one forward needs;
`cap` (max_cache_bytes), when given, bounds it further. This is vLLM's gpu_memory_utilization
contract. On a CPU, where the host's memory is shared with everything else on the node, the budget
is `cap` alone.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_DEFAULT_BYTES = 1 << 30
DRAFT_PREFILL_TOKENS = 4096  # positions of the longest prompt a draft replica's working buffers are sized for


class InsufficientMemoryError(RuntimeError):
    """The device cannot hold the weights, the working buffers and any KV cache at this utilization."""


# the most context positions one group of the varlen attention path gathers (app/model/ragged.py); a longer
# sequence is a group alone
VARLEN_GATHER_TOKENS = 1 << 16


def _attention_dims(config, tp_size: int) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of one tensor-parallel rank."""
    hidden = getattr(config, "hidden_size", 0)
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    return max(1, heads // tp_size) if heads else 0, max(1, kv_heads // tp_size) if kv_heads else 0, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of KV cache one position takes on one rank: keys and values of every layer."""
    _, kv_heads, head_dim = _attention_dims(config, tp_size)
    return 2 * getattr(config, "num_hidden_layers", 0) * kv_heads * head_dim * (torch.finfo(dtype).bits // 8)


@dataclass(frozen=True)
class ForwardSize:
    """The largest forward a runner serves, which its working buffers are sized for: `tokens`
    positions over sequences of up to `context` positions (max_model_len; default the model's), with
    logits for at most `logit_rows` rows (default every position) of at most `batch` sequences
    (default one per position)."""
    tokens: int
    context: int | None = None
    logit_rows: int | None = None
    batch: int | None = None


def working_bytes(config, dtype: torch.dtype, vocab: int, size: ForwardSize, *, attention: str = "flex",
                  tp_size: int = 1, device_type: str = "cuda") -> int:
    """Memory one forward of `size` works in on one rank, beyond weights and KV cache (an upper estimate):
    - logits: float32 for the `logit_rows` rows that get them (verify rows and prompts' last
      positions; default every position), the full vocabulary on every rank, and three more copies
      for sampled verification (padded, processed, sorted);
    - activations per position: the residual stream, the rank's attention projections and the MLP's
      two wide ones, with room for the allocator;
    - attention's scratch, by path (app/model/ragged.py, app/model/batches.py). "flex" and "cpu_paged" read the
      pool in place and materialise no [heads, tokens, context] scores: their output only.
      "per_sequence" (and "cpu_paged" for prompts) gathers one sequence's keys and values when its
      blocks are not one run, and builds its causal mask [tokens, context]. On a GPU SDPA's fused
      kernels take the mask without scores (app/model/ragged.py never lets it fall back to the math
      kernel there); on a CPU a masked SDPA is the math kernel: float32 scores and their softmax.
      "varlen" gathers a group's contexts (app/model/ragged.py: up to VARLEN_GATHER_TOKENS positions, or one
      sequence's) and its FlashAttention kernel holds no scores.
      "padded" (models with sliding windows or soft-capping) holds every layer's padded slab
      [batch, kv heads, context + width, D] for the forward, and eager attention's float32 scores
      [heads, tokens, context] and their softmax for one layer at a time."""
    hidden = getattr(config, "hidden_size", 0)
    wide = getattr(config, "intermediate_size", None) or 4 * hidden
    itemsize = torch.finfo(dtype).bits // 8
    heads, kv_heads, head_dim = _attention_dims(config, tp_size)
    tokens = size.tokens
    context = min(size.context or getattr(config, "max_position_embeddings", 0) or tokens, 1 << 40)
    rows = tokens if size.logit_rows is None else min(tokens, size.logit_rows)
    logits = rows * 4 * 4 * vocab
    activations = tokens * 2 * itemsize * (4 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * wide // tp_size)
    output = 2 * tokens * heads * head_dim * itemsize
    if attention in ("per_sequence", "cpu_paged"):
        scratch = 2 * kv_heads * context * head_dim * itemsize + tokens * context * itemsize
        if device_type == "cpu":
            scratch += 2 * 4 * heads * tokens * context
        else:  # on a GPU, keys and values repeated to the query heads for the fused kernel (GQA)
            scratch += 2 * heads * context * head_dim * itemsize
    elif attention == "varlen":  # a group's contexts gathered (keys, values), at least one whole sequence's
        scratch = 2 * kv_heads * max(context, VARLEN_GATHER_TOKENS) * head_dim * itemsize
    elif attention == "padded":
        layers = getattr(config, "num_hidden_layers", 0)
        seqs = max(1, min(size.batch or tokens, tokens))
        slab = layers * 2 * seqs * kv_heads * (context + tokens) * head_dim * itemsize
        scratch = slab + 2 * 4 * heads * tokens * (context + tokens)
    else:
        scratch = 0
    return logits + activations + output + scratch


def kv_budget(device: torch.device, *, utilization: float, cap: int | None, working: int, reserved: int = 0,
              mem_info: Callable[[torch.device], tuple[int, int]] | None = None) -> int:
    """The KV cache budget in bytes; call it after the weights are on the device. `reserved`: bytes
    promised to another cache on the same device but not allocated yet.
    mem_info(device) -> (free, total) bytes; torch.cuda.mem_get_info by default (injected by tests)."""
    if device.type != "cuda" and mem_info is None:
        return cap if cap is not None else CPU_DEFAULT_BYTES
    free, total = (mem_info or torch.cuda.mem_get_info)(device)
    allowed = int(utilization * total) - (total - free) - working - reserved
    if allowed <= 0:
        raise InsufficientMemoryError(
            f"{device}: {total / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB in use after loading, "
            f"{working / 2**30:.2f} GiB of working buffers: at memory_utilization {utilization} nothing is left "
            "for the KV cache; raise memory_utilization, shard wider (tensor_parallel_size) or lower max_batch_tokens")
    return allowed if cap is None else min(cap, allowed)


def agree_on_budget(runner) -> int:
    """Under tensor parallelism every rank must hold the same sequences (their collectives must match),
    so every rank takes the smallest rank's budget: an all-reduce (MIN) over the process group. Call it
    on every rank after size_kv_budget and before the first forward; returns the agreed budget."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return runner.cache.max_bytes
    device = runner.device if dist.get_backend() == "nccl" else torch.device("cpu")
    budget = torch.tensor([runner.cache.max_bytes], dtype=torch.int64, device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    runner.cache.max_bytes = int(budget.item())
    return runner.cache.max_bytes


def size_kv_budget(runner, utilization: float, cap: int | None, size: ForwardSize, *, reserved: int = 0,
                   mem_info: Callable[[torch.device], tuple[int, int]] | None = None, tp_size: int = 1) -> int:
    """Set a loaded ModelRunner's KV budget for forwards of up to `size`; returns it. Raises
    InsufficientMemoryError when the budget cannot hold one sequence of an explicit max_model_len
    (size.context)."""
    model = runner.model
    vocab = model.get_output_embeddings().out_features  # logits' width (a prepacked head has no .weight)
    if not getattr(runner, "ragged_logits", False):  # logits for every position
        size = ForwardSize(size.tokens, size.context, None, size.batch)
    working = working_bytes(model.config, model.dtype, vocab, size, attention=runner.attention_path,
                            tp_size=tp_size, device_type=runner.device.type)
    budget = kv_budget(runner.device, utilization=utilization, cap=cap, working=working, reserved=reserved,
                       mem_info=mem_info)
    per_token = kv_bytes_per_token(model.config, model.dtype, tp_size)
    max_model_len = size.context
    if max_model_len is not None and per_token and budget // per_token < max_model_len:
        raise InsufficientMemoryError(
            f"{runner.device}: the KV cache budget ({budget / 2**30:.2f} GiB, {budget // per_token} tokens) cannot "
            f"hold one sequence of max_model_len {max_model_len}: lower max_model_len, raise memory_utilization "
            "or max_cache_bytes, or shard wider (tensor_parallel_size)")
    runner.cache.max_bytes = budget
    return budget


def size_shared_kv_budget(runners: list, utilization: float, caps: list[int | None], size: ForwardSize,
                          mem_info: Callable[[torch.device], tuple[int, int]] | None = None) -> list[int]:
    """Budgets of runners that share one GPU and hold the same sequences (a target and its draft in
    one process), sized before either pool is made: what utilization leaves after both models'
    weights and working buffers, split by their KV bytes per token so that both hold the same number
    of tokens; each capped by its own max_cache_bytes. Apart (a CPU), each is sized on its own."""
    if runners[0].device.type != "cuda" and mem_info is None:
        return [size_kv_budget(r, utilization, cap, size) for r, cap in zip(runners, caps)]
    working = sum(working_bytes(r.model.config, r.model.dtype, r.model.get_output_embeddings().out_features, size,
                                attention=r.attention_path, device_type=r.device.type) for r in runners)
    max_model_len = size.context
    allowed = kv_budget(runners[0].device, utilization=utilization, cap=None, working=working, mem_info=mem_info)
    per_token = [kv_bytes_per_token(r.model.config, r.model.dtype) for r in runners]
    tokens = allowed // sum(per_token)
    if max_model_len is not None and tokens < max_model_len:
        raise InsufficientMemoryError(
            f"{runners[0].device}: target and draft together hold {tokens} tokens of KV cache, less than one "
            f"sequence of max_model_len {max_model_len}: lower max_model_len or raise memory_utilization")
    for r, p, cap in zip(runners, per_token, caps):
        r.cache.max_bytes = tokens * p if cap is None else min(cap, tokens * p)
    return [r.cache.max_bytes for r in runners]
