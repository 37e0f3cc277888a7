"""The paged CPU attention kernel (app/model/cpu_attention.py) against torch's SDPA over the same keys."""

import ctypes
import subprocess
import sys

import pytest
import torch

from app.model import cpu_attention, native
from app.model.kv import BLOCK_SIZE

pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C++ compiler to build the kernel")


class _Entry:
    def __init__(self, blocks):
        self.blocks = blocks


class _Span:
    def __init__(self, blocks, start, length, offset):
        self.entry, self.start, self.length, self.offset = _Entry(blocks), start, length, offset


def _reference(query, keys, values, spans, scale):
    """Each span's rows by SDPA over its keys gathered in table order, causal from its start (in float32)."""
    query, keys, values = query.float(), keys.float(), values.float()
    out = torch.zeros(1, query.shape[2], query.shape[1], query.shape[3])
    for s in spans:
        end = s.start + s.length
        slots = torch.tensor([b * BLOCK_SIZE + x for b in s.entry.blocks for x in range(BLOCK_SIZE)][:end])
        k, v = keys.index_select(1, slots).unsqueeze(0), values.index_select(1, slots).unsqueeze(0)
        q = query[:, :, s.offset : s.offset + s.length]
        mask = torch.arange(end) <= torch.arange(s.start, end).unsqueeze(1)
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=q.shape[1] != k.shape[1])
        out[:, s.offset : s.offset + s.length] = got.transpose(1, 2)
    return out


@pytest.mark.parametrize("heads_q,heads_kv,dim", [(4, 4, 64), (8, 2, 32), (6, 3, 80)])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_over_scattered_blocks(heads_q, heads_kv, dim, threads, dtype, monkeypatch):
    """Spans of 1 to 40 rows (past the kernel's row tile), starting anywhere (a block's middle, position 0), their tables in
    blocks scattered over the pool; queries strided as the model's projections leave them. bfloat16:
    within one rounding of float32 attention over the same (bfloat16) inputs."""
    gen = torch.Generator().manual_seed(heads_q * dim + threads)
    num_blocks = 64
    keys = torch.randn(heads_kv, num_blocks * BLOCK_SIZE, dim, generator=gen).to(dtype)
    values = torch.randn(heads_kv, num_blocks * BLOCK_SIZE, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    spans, offset = [], 0
    for rows, start in [(1, 0), (1, 37), (5, 90), (8, 15), (3, 47), (2, 160), (40, 0)]:
        n = -(-(start + rows) // BLOCK_SIZE)
        spans.append(_Span([free.pop() for _ in range(n)], start, rows, offset))
        offset += rows
    query = torch.randn(1, offset, heads_q, dim, generator=gen).to(dtype).transpose(1, 2)  # [1, Hq, T, D], strided
    out = torch.zeros(1, offset, heads_q, dim, dtype=dtype)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    cpu_attention.Spans(spans).attend(query, keys, values, out, dim ** -0.5)
    want = _reference(query, keys, values, spans, dim ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    else:  # one rounding to bfloat16 (2^-8 relative), of sums that differ from SDPA's in float32's last bits
        torch.testing.assert_close(out.float(), want, atol=1e-4, rtol=2 ** -8)
        assert (out.float() - want.to(dtype).float()).abs().max() <= want.abs().max() * 2 ** -7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    """The same span alone and among others: bit-identical rows (seeded output independent of batch)."""
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(2, 32 * BLOCK_SIZE, 16, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(1, 2, 9, 16, generator=gen).to(dtype)
    mine = _Span([5, 9, 2], 40, 4, 5)
    alone = torch.zeros(1, 9, 2, 16, dtype=dtype)
    cpu_attention.Spans([mine]).attend(query, keys, values, alone, 0.25)
    crowded = torch.zeros(1, 9, 2, 16, dtype=dtype)
    cpu_attention.Spans([_Span([1, 3], 20, 5, 0), mine]).attend(query, keys, values, crowded, 0.25)
    assert torch.equal(alone[:, 5:], crowded[:, 5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_row_equals_the_plain_step_at_its_position(dtype):
    """A span of 5 rows (a verify) and five 1-row spans at the same positions (plain steps): bit-identical
    rows, every query head of a GQA group among them, so greedy speculation keeps plain decoding's tokens."""
    gen = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(2, 32 * BLOCK_SIZE, 64, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(1, 6, 5, 64, generator=gen).to(dtype)
    table = [7, 3, 11, 0, 5]
    verify = torch.zeros(1, 5, 6, 64, dtype=dtype)
    cpu_attention.Spans([_Span(table, 37, 5, 0)]).attend(query, keys, values, verify, 0.125)
    steps = torch.zeros(1, 5, 6, 64, dtype=dtype)
    cpu_attention.Spans([_Span(table, 37 + r, 1, r) for r in range(5)]).attend(query, keys, values, steps, 0.125)
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_new_keys_and_values_as_the_indexed_copy_does(threads, dtype, monkeypatch):
    """Given the row's new keys and values ([1, Hkv, T', D], padded past the spans' rows), the kernel writes
    each span's rows into its slots, then attends: the pool and the outputs equal an indexed copy's
    followed by the kernel; the padding's and every other slot are untouched."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(11)
    heads_q, heads_kv, dim, num_blocks = 6, 3, 64, 24
    pool = [torch.randn(heads_kv, num_blocks * BLOCK_SIZE, dim, generator=gen).to(dtype) for _ in range(2)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    spans, offset = [], 0
    for rows, start in [(1, 0), (5, 37), (1, 15), (3, 46)]:
        spans.append(_Span([free.pop() for _ in range(-(-(start + rows) // BLOCK_SIZE))], start, rows, offset))
        offset += rows
    width = offset + 3  # a compiled step's padding rows
    new = [torch.randn(1, width, heads_kv, dim, generator=gen).to(dtype).transpose(1, 2) for _ in range(2)]  # strided
    query = torch.randn(1, heads_q, width, dim, generator=gen).to(dtype)
    slots = torch.tensor([s.entry.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for s in spans for p in range(s.start, s.start + s.length)])
    copied = [t.clone() for t in pool]
    for t, n in zip(copied, new):
        t.index_copy_(1, slots, n[0, :, :offset])
    want = torch.zeros(1, width, heads_q, dim, dtype=dtype)
    cpu_attention.Spans(spans).attend(query, *copied, want, 0.125)
    got = torch.zeros(1, width, heads_q, dim, dtype=dtype)
    cpu_attention.Spans(spans, every=True).attend(query, *pool, got, 0.125, tuple(new))
    assert torch.equal(pool[0], copied[0]) and torch.equal(pool[1], copied[1])
    assert torch.equal(got, want)


def test_far_below_the_maximum_weights_are_zero_not_nan():
    """A row whose scores span hundreds (weights past float's range): finite, the top key's value."""
    keys = torch.zeros(1, BLOCK_SIZE, 4)
    keys[0, 3] = 100.0
    values = torch.arange(BLOCK_SIZE * 4, dtype=torch.float32).view(1, BLOCK_SIZE, 4)
    query = torch.ones(1, 1, 1, 4)
    out = torch.zeros(1, 1, 1, 4)
    cpu_attention.Spans([_Span([0], 9, 1, 0)]).attend(query, keys, values, out, 1.0)
    torch.testing.assert_close(out[0, 0, 0], values[0, 3])


def test_loading_the_kernel_leaves_the_process_floating_point_mode_alone():
    """Built with -ffast-math, but never linked with it: denormals still exist in the process after
    the library loads (GCC's fast-math start-up code would flush them to zero everywhere)."""
    lib = native.build(cpu_attention.SOURCE, cpu_attention._FLAGS)
    code = (f"import ctypes, torch; x = torch.tensor([1e-40]); ctypes.CDLL({str(lib)!r}); "
            "print((x * 1).item() > 0, (torch.tensor([1e-39]) / 2).item() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]
    assert ctypes.CDLL(str(lib)) is not None


def test_without_a_compiler_attention_stays_per_sequence(monkeypatch, tmp_path, target_model, tokenizer):
    """No compiler and nothing cached: auto is one SDPA call per sequence; asking for the kernel is an error."""
    from app.model.runner import Execution, ModelRunner

    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    assert native.build(cpu_attention.SOURCE, cpu_attention._FLAGS) is None
    assert ModelRunner(target_model, tokenizer).attention == "per_sequence"
    with pytest.raises(ValueError, match="cpu_paged"):
        ModelRunner(target_model, tokenizer, Execution(attention="cpu_paged"))


def test_float32_and_bfloat16_pools_on_a_cpu_take_the_kernel():
    assert cpu_attention.usable(torch.float32, torch.device("cpu"))
    assert cpu_attention.usable(torch.bfloat16, torch.device("cpu"))
    assert not cpu_attention.usable(torch.float16, torch.device("cpu"))
    assert not cpu_attention.usable(torch.float32, torch.device("meta"))


def test_a_bfloat16_models_steps_through_the_kernel_match_its_per_sequence_attention(target_model, tokenizer):
    """A bfloat16 model's decode and verify logits by the kernel and by SDPA per sequence: the same up to
    bfloat16's rounding of the attention outputs."""
    import copy

    from app.model.batches import SeqInput
    from app.model.runner import Execution, ModelRunner

    model = copy.deepcopy(target_model).to(torch.bfloat16)
    runners = {a: ModelRunner(copy.deepcopy(model), tokenizer, Execution(attention=a))
               for a in ("cpu_paged", "per_sequence")}
    assert runners["cpu_paged"].attention == "cpu_paged"
    prompts = [list(range(2, 40)), list(range(5, 22))]
    logits = {}
    for name, runner in runners.items():
        runner.forward([SeqInput(f"s{i}", p, 1) for i, p in enumerate(prompts)])
        step = runner.forward([SeqInput(f"s{i}", p + [7, 8, 9], 3) for i, p in enumerate(prompts)])
        logits[name] = torch.cat([x.float() for x in step])
    torch.testing.assert_close(logits["cpu_paged"], logits["per_sequence"], atol=0.05, rtol=0.02)


def _python_body_calls(run) -> int:
    """How many times `run()` called the op's Python body (specserve::ragged_attention_python)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key == "specserve::ragged_attention_python")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_cpp_kernel_gives_its_python_bodys_bits(dtype, target_model, tokenizer, monkeypatch):
    """Decode steps and verify rows through the op's C++ CPU kernel (bound to the forward, no Python in the
    call) and through its Python body: the same logits, bit for bit. Prompts take the kernel too: their
    forward is bound as well, and no layer's call takes the Python body."""
    import copy

    from app.model.batches import SeqInput
    from app.model.runner import Execution, ModelRunner

    runner = ModelRunner(copy.deepcopy(target_model).to(dtype), tokenizer, Execution(attention="cpu_paged"))
    if cpu_attention.implementation() != "C++":
        pytest.skip("the op's C++ kernel did not build here (torch's headers)")
    layers = runner.kv_shape()[0]
    prompts = [list(range(2, 40)), list(range(5, 22))]
    assert _python_body_calls(lambda: runner.forward([SeqInput(f"s{i}", p, 1) for i, p in enumerate(prompts)])) == 0

    def steps():
        out = []
        for extra, n in (([7], 1), ([7, 8, 9, 10], 4)):  # a decode step, then a verify of 4 rows (one rolled back)
            batch = runner.open([SeqInput(f"s{i}", p + extra, n) for i, p in enumerate(prompts)])
            out.append(torch.cat([x.float() for x in batch.logits]))
            batch.close([len(p) for p in prompts])  # back to the prompts: the next call computes the same rows
        return torch.cat(out)

    logits = {}
    calls = {"C++": _python_body_calls(lambda: logits.setdefault("C++", steps()))}
    monkeypatch.setitem(cpu_attention._op, "impl", "Python")  # nothing bound: the C++ kernel calls the body
    calls["Python"] = _python_body_calls(lambda: logits.setdefault("Python", steps()))
    assert calls == {"C++": 0, "Python": 2 * layers}
    assert torch.equal(logits["C++"], logits["Python"])
