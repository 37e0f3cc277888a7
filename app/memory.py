"""How much KV cache a replica (or a tensor-parallel rank) may hold, from its device's memory.

On a GPU the budget is what is left of `utilization` × the device's memory once the weights are
loaded (and whatever else already holds memory on it), less the working buffers one forward needs;
`cap` (max_cache_bytes), when given, bounds it further. This is vLLM's gpu_memory_utilization
contract. On a CPU, where the host's memory is shared with everything else on the node, the budget
is `cap` alone.
"""

from collections.abc import Callable

import torch

CPU_DEFAULT_BYTES = 1 << 30


class InsufficientMemoryError(RuntimeError):
    """The device cannot hold the weights, the working buffers and any KV cache at this utilization."""


def working_bytes(config, dtype: torch.dtype, tokens: int, vocab: int, context: int | None = None) -> int:
    """Memory one forward of `tokens` positions works in, beyond weights and KV cache (an upper
    estimate): the float32 logits of every position and three more copies of them for sampled
    verification (padded, processed, sorted), plus per-position activations (the residual stream,
    the attention projections, the MLP's two wide ones, with room for the allocator); and attention's
    own scratch for one layer at a time over keys of `context` positions (default: the model's): a
    sequence whose blocks are not one run is gathered (its keys and values, once), and a masked
    attention that falls back to the math kernel holds float32 scores [heads, tokens, context] and
    their softmax."""
    hidden = getattr(config, "hidden_size", 0)
    wide = getattr(config, "intermediate_size", 4 * hidden)
    itemsize = torch.finfo(dtype).bits // 8
    per_position = 4 * 4 * vocab + 2 * itemsize * (6 * hidden + 3 * wide)
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    context = context or getattr(config, "max_position_embeddings", 0) or tokens
    gathered = 2 * kv_heads * context * head_dim * itemsize
    scores = 2 * 4 * heads * min(tokens, context) * context
    return tokens * per_position + gathered + scores


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


def size_kv_budget(runner, utilization: float, cap: int | None, forward_tokens: int, reserved: int = 0,
                   mem_info: Callable[[torch.device], tuple[int, int]] | None = None) -> int:
    """Set a loaded ModelRunner's KV budget for forwards of up to `forward_tokens` positions; returns it."""
    model = runner.model
    rows = model.get_output_embeddings().out_features  # logits' width (a prepacked head has no .weight)
    working = working_bytes(model.config, model.dtype, forward_tokens, rows)
    runner.cache.max_bytes = kv_budget(runner.device, utilization=utilization, cap=cap, working=working,
                                       reserved=reserved, mem_info=mem_info)
    return runner.cache.max_bytes
