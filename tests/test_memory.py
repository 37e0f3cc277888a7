"""KV budgets from the device's memory (app/model/memory.py), with the device's memory report injected."""

import pytest
import torch

from app.model.memory import (
    CPU_DEFAULT_BYTES,
    ForwardSize,
    InsufficientMemoryError,
    kv_budget,
    size_kv_budget,
    working_bytes,
)
from app.model.runner import ModelRunner

GiB = 2**30
CUDA = torch.device("cuda", 0)


def h100_after_loading(used: float):
    """An 80 GB H100's (free, total) once `used` GiB are taken (weights, CUDA context)."""
    total = int(79.1 * GiB)
    return lambda device: (total - int(used * GiB), total)


def test_the_budget_is_what_utilization_leaves_after_weights_and_buffers():
    budget = kv_budget(CUDA, utilization=0.9, cap=None, working=2 * GiB, mem_info=h100_after_loading(35))
    assert budget == int(0.9 * int(79.1 * GiB)) - 35 * GiB - 2 * GiB
    # a configured cap only lowers it: 96 GiB on this GPU would have overcommitted it
    assert kv_budget(CUDA, utilization=0.9, cap=96 * GiB, working=2 * GiB, mem_info=h100_after_loading(35)) == budget
    assert kv_budget(CUDA, utilization=0.9, cap=8 * GiB, working=2 * GiB, mem_info=h100_after_loading(35)) == 8 * GiB
    # working buffers and a sibling cache's promised bytes are counted
    assert kv_budget(CUDA, utilization=0.9, cap=None, working=3 * GiB, mem_info=h100_after_loading(35)) == budget - GiB
    assert kv_budget(CUDA, utilization=0.9, cap=None, working=2 * GiB, reserved=5 * GiB,
                     mem_info=h100_after_loading(35)) == budget - 5 * GiB


def test_no_room_left_is_a_clear_error():
    with pytest.raises(InsufficientMemoryError, match="memory_utilization 0.5"):
        kv_budget(CUDA, utilization=0.5, cap=None, working=GiB, mem_info=h100_after_loading(40))


def test_on_a_cpu_the_budget_is_the_configured_one():
    assert kv_budget(torch.device("cpu"), utilization=0.9, cap=None, working=GiB) == CPU_DEFAULT_BYTES
    assert kv_budget(torch.device("cpu"), utilization=0.9, cap=123_456, working=GiB) == 123_456


def real_config(name: str):
    """A shipped model's config (cluster/model_configs: the models the GPU manifests name)."""
    import json

    from transformers import AutoConfig

    from specserve.plan import CONFIGS

    return AutoConfig.for_model(**json.loads((CONFIGS / name / "config.json").read_text()))


def test_working_buffers_grow_with_the_forward_and_the_vocabulary():
    cfg = real_config("meta-llama/Llama-3.1-8B-Instruct")
    small, big = (working_bytes(cfg, torch.bfloat16, 128256, ForwardSize(n, 8192)) for n in (256, 2048))
    assert big > 7 * small and small > 256 * 4 * 128256  # at least the float32 logits of every position


@pytest.mark.parametrize("name, tokens, rows, tp, most", [
    ("meta-llama/Llama-3.1-8B-Instruct", 2048, 320, 1, 6 * GiB),   # the target server: 32 x (K_max + 2) rows
    ("meta-llama/Llama-3.1-70B-Instruct", 2048, 320, 4, 6 * GiB),
    ("meta-llama/Llama-3.2-1B-Instruct", 4096, 16, 1, 6 * GiB),    # the draft server: a row per sequence
])
def test_real_configs_at_their_full_context_need_gigabytes_of_working_memory_not_a_hundred(name, tokens, rows, tp,
                                                                                           most):
    """Attention scores [heads, tokens, context] were budgeted at the model's 131072 positions for every
    path: 68.9 GiB for the 8B at 2048 tokens, 133.4 GiB per rank for the 70B, 136.6 GiB for the 1B
    draft. The ragged paths materialise no scores; the padded one does, for the context it serves."""
    cfg = real_config(name)
    assert cfg.num_attention_heads > 0 and cfg.max_position_embeddings == 131072
    for path in ("flex", "per_sequence", "cpu_paged", "varlen"):
        work = working_bytes(cfg, torch.bfloat16, cfg.vocab_size, ForwardSize(tokens, logit_rows=rows), attention=path,
                             tp_size=tp)
        assert work < most, (path, work / GiB)
    # the padded path holds every layer's slab and the scores: budgeted, and far larger at full context
    padded = working_bytes(cfg, torch.bfloat16, cfg.vocab_size, ForwardSize(tokens, logit_rows=rows, batch=32),
                           attention="padded", tp_size=tp)
    assert padded > 10 * most
    # logits only for the rows that get them: a verify batch of 32 x 9 rows, not 2048
    assert working_bytes(cfg, torch.bfloat16, cfg.vocab_size, ForwardSize(tokens, logit_rows=288), tp_size=tp) < (
        working_bytes(cfg, torch.bfloat16, cfg.vocab_size, ForwardSize(tokens), tp_size=tp) - (tokens - 288) * 16 * cfg.vocab_size + 1)


def test_a_rank_budgets_its_share_of_the_heads_and_of_the_kv():
    from app.model.memory import kv_bytes_per_token

    cfg = real_config("meta-llama/Llama-3.1-70B-Instruct")
    assert kv_bytes_per_token(cfg, torch.bfloat16, 1) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(cfg, torch.bfloat16, 4) == 2 * 80 * 2 * 128 * 2
    one, four = (working_bytes(cfg, torch.bfloat16, 128256, ForwardSize(2048), attention="per_sequence", tp_size=t) for t in (1, 4))
    assert four < one


def test_a_replica_that_cannot_hold_one_sequence_of_max_model_len_refuses_to_start(target_model, tokenizer):
    from app.model.memory import kv_bytes_per_token

    runner = ModelRunner(target_model, tokenizer)
    runner.device = CUDA
    per_token = kv_bytes_per_token(target_model.config, torch.float32)
    work = working_bytes(target_model.config, torch.float32, 98, ForwardSize(512, 1000), attention=runner.attention_path)
    total = int(79.1 * GiB)

    def leaving(tokens):  # a device whose memory_utilization share leaves room for `tokens` positions
        used = int(0.9 * total) - work - tokens * per_token
        return lambda device: (total - used, total)

    with pytest.raises(InsufficientMemoryError, match="max_model_len 1000: lower max_model_len"):
        size_kv_budget(runner, 0.9, None, ForwardSize(512, 1000), mem_info=leaving(999))
    assert size_kv_budget(runner, 0.9, None, ForwardSize(512, 1000), mem_info=leaving(1000)) == 1000 * per_token


def test_in_process_target_and_draft_split_one_budget_made_before_either_pool(target_model, tokenizer):
    """Finding: Engine.from_config sized the target (whose warm-up forward then made its pool at the
    whole budget), then sized the draft with the target's budget reserved again: counted twice, the
    draft's budget went negative. Now both are sized before either pool exists, from one budget."""
    from conftest import make_model

    from app.model.memory import kv_bytes_per_token, size_shared_kv_budget

    total, weights = int(79.1 * GiB), 10 * GiB
    before_pools = lambda d: (total - weights, total)  # noqa: E731 - both models loaded, no pool yet
    target, draft = ModelRunner(target_model, tokenizer), ModelRunner(make_model(7, layers=1), tokenizer)
    # the old order: the target takes the whole share, its pool lands on the device, then the draft
    target.device = draft.device = CUDA
    size_kv_budget(target, 0.9, None, ForwardSize(512), mem_info=before_pools)
    after_pool = lambda d: (total - weights - target.cache.max_bytes, total)  # noqa: E731
    with pytest.raises(InsufficientMemoryError):
        size_kv_budget(draft, 0.9, None, ForwardSize(512), mem_info=after_pool, reserved=target.cache.max_bytes)
    # one budget, split so both hold the same tokens
    t_bytes, d_bytes = size_shared_kv_budget([target, draft], 0.9, [None, None], ForwardSize(512), mem_info=before_pools)
    pt, pd = (kv_bytes_per_token(r.model.config, r.model.dtype) for r in (target, draft))
    assert t_bytes > 0 and d_bytes > 0 and t_bytes // pt == d_bytes // pd
    work = sum(working_bytes(r.model.config, torch.float32, 98, ForwardSize(512), attention=r.attention_path) for r in (target, draft))
    assert int(0.9 * total) - weights - work - pt - pd < t_bytes + d_bytes <= int(0.9 * total) - weights - work
    # a byte cap still bounds its own model
    assert size_shared_kv_budget([target, draft], 0.9, [None, GiB], ForwardSize(512), mem_info=before_pools)[1] == GiB


def test_admission_refuses_a_context_past_the_kv_budget(target_model, tokenizer):
    from app.engine import Engine
    from app.errors import ContextLengthError
    from app.params import SamplingParams

    runner = ModelRunner(target_model, tokenizer, max_cache_bytes=4 * ModelRunner(target_model, tokenizer).kv_block_bytes())
    engine = Engine(runner)
    assert engine.max_context == runner.capacity_tokens() == 64 < runner.max_context
    with pytest.raises(ContextLengthError, match="KV cache budget is 64 tokens"):
        engine.new_request(list(range(2, 70)), SamplingParams(max_tokens=4))
    # what fits is served, and generation stops at the budget, never past it (no recompute from scratch)
    out = engine.generate([list(range(2, 50))], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 - 48 and out.finish_reason == "length"
    assert runner.cache.evictions == 0


def _agree(rank: int, world: int, port: int, budgets: list[int], out) -> None:
    import types

    from app.model.memory import agree_on_budget

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        runner = types.SimpleNamespace(cache=types.SimpleNamespace(max_bytes=budgets[rank]), device=torch.device("cpu"))
        out.put((rank, agree_on_budget(runner)))
    finally:
        torch.distributed.destroy_process_group()


def test_tensor_parallel_ranks_agree_on_the_smallest_budget():
    """Each rank sizes its budget from its own device's free memory (injected here as three different
    figures); under gloo they agree on the minimum, so they evict alike and their collectives match."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    budgets = [5 * GiB, 3 * GiB, 4 * GiB]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, 3, port, budgets, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)  # a bound on a hang: three processes start torch
    for p in procs:
        p.join(timeout=60)
    assert results == {0: 3 * GiB, 1: 3 * GiB, 2: 3 * GiB}


def test_a_gpus_per_sequence_attention_repeats_kv_heads_for_the_fused_kernel_and_equals_the_plain_call():
    """On a GPU a masked GQA call would have only the math kernel (scores the memory model does not
    budget): keys and values are repeated to the query heads instead. Run here on a CPU, whose flash
    kernel takes masks too (forced, as a GPU's memory-efficient kernel would be chosen): the same
    attention as the plain GQA call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from app.model.ragged import sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((8, 5), (2, 20), (2, 20)))
    mask = torch.zeros(5, 20).masked_fill_(torch.arange(20) > torch.arange(15, 20).unsqueeze(1), -torch.inf)
    plain = sdpa(q, k, v, mask, 0.25, gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no math kernel to fall back to
        fused = sdpa(q, k, v, mask, 0.25, gqa=True, fused_only=True)
    assert torch.allclose(fused, plain, atol=1e-5)
    # what a GPU said of the masked GQA call (H100, torch 2.11): "For dense input, both fused kernels
    # require query, key and value to have the same num_heads"; the repeated call has them equal
