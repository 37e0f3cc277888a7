"""KV budgets from the device's memory (app/memory.py), with the device's memory report injected."""

import pytest
import torch

from app.memory import (
    CPU_DEFAULT_BYTES,
    InsufficientMemoryError,
    kv_budget,
    size_kv_budget,
    working_bytes,
)
from app.runner import ModelRunner

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


def test_working_buffers_grow_with_the_forward_and_the_vocabulary():
    cfg = type("C", (), {"hidden_size": 4096, "intermediate_size": 14336})()
    small, big = (working_bytes(cfg, torch.bfloat16, n, 128256) for n in (256, 2048))
    assert big == 8 * small and small > 256 * 4 * 128256  # at least the float32 logits of every position


def test_a_runner_takes_its_budget_from_its_device(target_model, tokenizer):
    runner = ModelRunner(target_model, tokenizer)
    runner.device = CUDA  # as a GPU replica reports it; the memory report is injected
    budget = size_kv_budget(runner, 0.9, None, 512, mem_info=h100_after_loading(10))
    assert runner.cache.max_bytes == budget
    assert budget == int(0.9 * int(79.1 * GiB)) - 10 * GiB - working_bytes(target_model.config, torch.float32, 512, 98)


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

    from app.memory import agree_on_budget

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
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: 3 * GiB, 1: 3 * GiB, 2: 3 * GiB}
