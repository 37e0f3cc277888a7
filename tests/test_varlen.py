"""The varlen attention path (app/model/ragged.py): a batch's sequences in one kernel call per layer, in
groups bounded by the positions they gather, each sequence's logits a fresh forward's; the CUDA
kernel asked for causal attention aligned to the bottom right, one KV split and grouped heads."""

import functools
import math

import pytest
import torch

from app.model import varlen
from app.model.runner import Execution, ModelRunner, SeqInput
from test_runner import ATOL, fresh_logits, random_ids


def count_calls(monkeypatch) -> list[tuple[int, int]]:
    """The kernel's calls, as (max queries, max keys), each running the reference."""
    calls = []

    def kernel(device):
        def run(*args):
            calls.append((args[3].max_q, args[3].max_k))
            return varlen.varlen_reference(*args)
        return run

    monkeypatch.setattr(varlen, "varlen_kernel", kernel)
    return calls


def batch(n: int) -> list[SeqInput]:
    """n sequences of 5, 8, 11... positions, the last 1-3 of each getting logits (decode and verify rows)."""
    return [SeqInput(f"s{i}", random_ids(10 + i, 5 + 3 * i), 1 + i % 3) for i in range(n)]


def test_a_whole_batch_takes_one_kernel_call_per_layer(monkeypatch, target_model, tokenizer):
    runner = ModelRunner(target_model, tokenizer, Execution(attention="varlen"))
    calls = count_calls(monkeypatch)
    seqs = batch(8)
    out = runner.forward(seqs)
    assert len(calls) == target_model.config.num_hidden_layers  # not 8 per layer
    assert calls[0] == (max(len(s.token_ids) for s in seqs),) * 2  # prompts: queries and keys alike
    for s, logits in zip(seqs, out):
        torch.testing.assert_close(logits, fresh_logits(target_model, s.token_ids, s.num_logits), atol=ATOL, rtol=0)
    # decode rows over the cached prompts: one query each, every key
    calls.clear()
    rows = [SeqInput(s.seq_id, s.token_ids + [7, 9], 2) for s in seqs]
    for s, logits in zip(rows, runner.forward(rows)):
        torch.testing.assert_close(logits, fresh_logits(target_model, s.token_ids, 2), atol=ATOL, rtol=0)
    assert calls[0] == (2, max(len(s.token_ids) for s in rows))


def test_groups_end_where_the_gather_would_pass_its_bound(monkeypatch, target_model, tokenizer):
    """Contexts of 5, 8, 11, 14 | 17, 20 | 23 | 26 | 50 positions under a bound of 40: five groups, the
    50-position sequence alone (a group holds at least one sequence, whatever its length)."""
    monkeypatch.setattr(varlen, "VARLEN_GATHER_TOKENS", 40)
    runner = ModelRunner(target_model, tokenizer, Execution(attention="varlen"))
    calls = count_calls(monkeypatch)
    seqs = batch(8) + [SeqInput("long", random_ids(99, 50), 3)]
    out = runner.forward(seqs)
    assert len(calls) == 5 * target_model.config.num_hidden_layers
    assert [k for _, k in calls[:5]] == [14, 20, 23, 26, 50]
    for s, logits in zip(seqs, out):
        torch.testing.assert_close(logits, fresh_logits(target_model, s.token_ids, s.num_logits), atol=ATOL, rtol=0)


def test_the_reference_is_causal_from_the_bottom_right():
    """Two queries that are the last of five keys: the first sees keys 0-3, the second all five."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    out = varlen.varlen_reference(q, k, v, varlen.Packing(torch.tensor([0, 2]), torch.tensor([0, 5]), 2, 5), 0.5, False)
    for j, seen in enumerate((4, 5)):
        weights = torch.softmax((k[:seen, 0] @ q[j, 0]) * 0.5, 0)
        torch.testing.assert_close(out[j, 0], weights @ v[:seen, 0])
    assert not math.isclose(out[0, 0, 0].item(), (torch.softmax((k[:, 0] @ q[0, 0]) * 0.5, 0) @ v[:, 0])[0].item())


def test_the_cuda_kernel_is_asked_for_bottom_right_causal_attention_one_split_and_grouped_heads(monkeypatch):
    """torch's varlen_attn, as the CUDA path calls it (its signature read once): causal as the window
    (-1, 0), num_splits 1 (a sequence's result does not depend on its batch), GQA by the kernel."""
    import torch.nn.attention.varlen as torch_varlen

    seen = {}

    @functools.wraps(torch_varlen.varlen_attn)  # the real one's signature: the path reads it
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.update(kwargs)
        return varlen.varlen_reference(q, k, v, varlen.Packing(cu_q, cu_k, max_q, max_k), kwargs["scale"],
                                       kwargs["enable_gqa"])

    monkeypatch.setattr(torch_varlen, "varlen_attn", fake)
    kernel = varlen.varlen_kernel.__wrapped__(torch.device("cuda"))  # the CUDA path, not its cached instance
    q, k, v = torch.randn(3, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    cu_q, cu_k = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    packing = varlen.Packing(cu_q, cu_k, 2, 4)
    out = kernel(q, k, v, packing, 0.25, True)
    assert seen == {"window_size": (-1, 0), "num_splits": 1, "enable_gqa": True, "scale": 0.25}
    torch.testing.assert_close(out, varlen.varlen_reference(q, k, v, packing, 0.25, True))


@pytest.mark.parametrize("mode", ["off", "default"])
def test_compiled_steps_over_varlen_attention_give_the_eager_tokens_and_never_recompile(mode, target_model, tokenizer):
    """The GPU's shape: symbolic token counts, attention one varlen call per layer (its op opaque to
    the graph), mixed batches once warm with recompiles an error."""
    from app.model.compiled import CompiledSteps
    from app.engine import Engine
    from test_engine import PROMPTS, greedy, reference

    runner = ModelRunner(target_model, tokenizer, Execution(attention="varlen", compile=mode, compile_max_tokens=8))
    if mode != "off":
        runner.steps = CompiledSteps(target_model, mode, 8, dynamic=True)
    runner.warm()
    assert (runner.steps is not None) == (mode != "off")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = Engine(runner).generate(PROMPTS, greedy())
    for r in out:
        assert r.token_ids == reference(target_model, r.prompt_token_ids, 24)


def top_level_ops(fn) -> int:
    """The aten ops fn dispatches from Python (each a kernel launch or a view on a GPU), not counting
    the ops inside them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return e.name.startswith("aten::")

    return sum(outermost(e) for e in prof.events())


def test_a_decode_forward_dispatches_as_many_ops_at_batch_32_as_at_batch_1(monkeypatch, target_model, tokenizer):
    """The host-side cost a GPU forward pays per kernel: with the kernel one op (as FlashAttention's
    is), the varlen path's ops do not grow with the batch; per sequence they do (this model, 2
    layers: every sequence adds its SDPA call, mask and views per layer)."""
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device: lambda q, k, v, *rest: torch.ops.aten.clone(q))
    counts = {}
    for path in ("varlen", "per_sequence"):
        for b in (1, 32):
            runner = ModelRunner(target_model, tokenizer, Execution(attention=path))
            runner.compact_tables = False
            seqs = [SeqInput(f"s{i}", random_ids(i, 30), 1) for i in range(b)]
            runner.forward(seqs)
            steps = [SeqInput(s.seq_id, s.token_ids + [5], 1) for s in seqs]
            counts[path, b] = top_level_ops(lambda: runner.forward(steps))
    assert counts["varlen", 32] == counts["varlen", 1]
    assert counts["per_sequence", 32] > counts["per_sequence", 1] + 31 * 2 * target_model.config.num_hidden_layers


def test_auto_takes_varlen_for_half_precision_on_a_gpu():
    """On a GPU `auto` batches a forward's attention into varlen calls where FlashAttention takes the
    dtype (on an H200 it ran 32 requests in 1.1 s against 1.8 s per sequence); float32 keeps one SDPA
    call per sequence, and a CPU its paged kernel where that builds."""
    from app.model.runner import auto_attention

    assert varlen.varlen_available()  # torch 2.10+: the pinned torch has it
    assert auto_attention(torch.bfloat16, "cuda", False) == auto_attention(torch.float16, "cuda", False) == "varlen"
    assert auto_attention(torch.float32, "cuda", False) == "per_sequence"
    assert auto_attention(torch.float32, "cpu", True) == auto_attention(torch.bfloat16, "cpu", True) == "cpu_paged"
    assert auto_attention(torch.bfloat16, "cpu", False) == "per_sequence"  # no C++ compiler


def test_shape_free_sdpa_turns_cudnn_attention_off():
    """cuDNN's attention builds a plan per new (queries, keys) shape, which per-sequence calls meet every
    round (H200: 32 requests of 16 tokens in 33.1 s with it, 1.8 s without); a runner on CUDA calls this.
    The flag is torch's own, read back."""
    from app.model import ragged

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        ragged.shape_free_sdpa()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
