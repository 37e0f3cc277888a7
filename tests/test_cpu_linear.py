"""The small-row CPU linear (app/model/cpu_linear.py, app/model/kernels/small_gemm.cpp): the same product as
F.linear to rounding, bit-identical rows whatever else is in the call, and the same tokens compiled
and eager."""

import copy
import threading

import pytest
import torch
from torch import nn

from app.model import cpu_linear, native
from app.model.runner import Execution, ModelRunner, SeqInput

pytestmark = pytest.mark.skipif(not cpu_linear.kernel_available(), reason="no C++ compiler to build the kernel")


def _weights(out_features: int, in_features: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen).to(dtype), torch.randn(out_features, generator=gen)


# shapes off the group width and the row tile: tails of columns, one row, a tile and a remainder
@pytest.mark.parametrize("out_features, in_features, rows", [(1, 3, 1), (70, 33, 5), (200, 64, 7), (130, 17, 13)])
def test_the_product_is_f_linear_to_rounding(out_features, in_features, rows):
    weight, bias = _weights(out_features, in_features)
    x = torch.randn(2, rows, in_features)
    got = cpu_linear.linear(x, cpu_linear.pack(weight), bias, out_features)
    assert got.shape == (2, rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_widen_exactly_and_the_result_rounds_once():
    weight, _ = _weights(96, 40, torch.bfloat16)
    x = torch.randn(3, 40).to(torch.bfloat16)
    got = cpu_linear.linear(x, cpu_linear.pack(weight), None, 96)
    assert got.dtype == torch.bfloat16
    want = nn.functional.linear(x.float(), weight.float()).to(torch.bfloat16)  # float32 sums, one rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


CASES = [  # rows' dtype, weights' dtype, pairs, input size (odd: the pairs' padding), bias
    (torch.float32, torch.float32, False, 40, True), (torch.float32, torch.bfloat16, False, 33, False),
    (torch.bfloat16, torch.bfloat16, False, 40, True), (torch.bfloat16, torch.bfloat16, True, 33, True),
    (torch.bfloat16, torch.bfloat16, True, 40, False), (torch.float16, torch.float32, False, 40, True),
    (torch.float32, torch.int8, False, 33, True), (torch.bfloat16, torch.int8, True, 33, True),
    (torch.float32, torch.int8, True, 40, False),  # int8: a draft's `packed_weights: int8`
    (torch.bfloat16, torch.int4, True, 33, True), (torch.float32, torch.int4, True, 72, False),  # int4 blocks
    (torch.bfloat16, torch.int4, True, 64, False),  # whole blocks: no padding to copy the strided rows
]


@pytest.mark.parametrize("x_dtype, w_dtype, pairs, in_features, with_bias", CASES)
def test_the_ops_cpp_kernel_gives_its_python_bodys_bits(x_dtype, w_dtype, pairs, in_features, with_bias):
    """specserve::linear runs app/model/kernels/linear_op.cpp where it builds; `_linear` is the same op
    in Python (the fallback): every dtype path, non-contiguous rows, a compiled step's real rows."""
    assert cpu_linear.implementation() == "C++"  # it builds wherever the kernel does (same compiler)
    if pairs and not cpu_linear.pairs_available() or w_dtype == torch.int4 and not cpu_linear.int4_available():
        pytest.skip("this CPU has no AVX512-BF16")
    int8, int4 = w_dtype == torch.int8, w_dtype == torch.int4
    quantized = int8 or int4
    weight, bias = _weights(150, in_features, torch.bfloat16 if quantized and pairs else torch.float32 if quantized
                            else w_dtype)
    packed = cpu_linear.pack(weight, pairs=pairs, int8=int8, int4=int4)
    bias = bias.to(x_dtype) if with_bias else None
    x = torch.randn(in_features, 2, 11).to(x_dtype).transpose(0, 2)  # [11, 2, in], not contiguous
    for real in (None, 3):
        if real is None:
            got, want = cpu_linear.linear(x, packed, bias, 150), cpu_linear._linear(x, packed, bias, 150)
            assert torch.equal(got, cpu_linear.linear(x.contiguous(), packed, bias, 150))  # strides read right
        else:
            with cpu_linear.real_rows(real):
                got, want = cpu_linear.linear(x, packed, bias, 150), cpu_linear._linear(x, packed, bias, 150)
            assert not got.view(-1, 150)[real:].any()  # rows past the real ones: zero, uncomputed
        assert got.dtype == want.dtype == x_dtype and got.shape == want.shape == (11, 2, 150)
        assert torch.equal(got.view(torch.int16 if x_dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if x_dtype != torch.float32 else torch.int32))


def _int8_reference(weight: torch.Tensor) -> torch.Tensor:
    """The weights int8 packing computes with: each output's weights in 255 steps of its largest / 127."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30)
    return torch.round(weight.float() / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("out_features, in_features, rows", [(1, 3, 1), (70, 33, 5), (200, 64, 7), (130, 17, 13)])
def test_int8_weights_give_the_product_of_their_steps(out_features, in_features, rows):
    """packed_weights int8: y = x (q * scale)^T + bias, q the int8 steps, summed in float32; a quarter of
    float32's bytes (the group's scales after its weights)."""
    weight, bias = _weights(out_features, in_features)
    weight[0] = 0  # an all-zero output keeps a usable scale
    packed = cpu_linear.pack(weight, int8=True)
    assert packed.dtype == torch.int8 and packed.shape[1] == in_features + cpu_linear.SCALE_ROWS
    x = torch.randn(2, rows, in_features)
    got = cpu_linear.linear(x, packed, bias, out_features)
    assert got.dtype == torch.float32 and not got[..., 0].sub(bias[0]).any()
    torch.testing.assert_close(got, nn.functional.linear(x, _int8_reference(weight), bias), rtol=1e-5, atol=1e-4)
    # a bfloat16 draft's rows: bfloat16 results, its rows widened exactly
    got = cpu_linear.linear(x.to(torch.bfloat16), packed, None, out_features)
    want = nn.functional.linear(x.to(torch.bfloat16).float(), _int8_reference(weight)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    if cpu_linear.pairs_available():  # a bfloat16 draft's int8 weights in pairs: the same steps, vdpbf16ps
        packed = cpu_linear.pack(weight.to(torch.bfloat16), pairs=True, int8=True)
        width = cpu_linear._kernel().specserve_gemm_group_width()
        assert packed.shape == (-(-out_features // width), (in_features + 1) // 2 + cpu_linear.SCALE_PAIRS, width, 2)
        got = cpu_linear.linear(x.to(torch.bfloat16), packed, bias.to(torch.bfloat16), out_features)
        want = nn.functional.linear(x.to(torch.bfloat16).float(), _int8_reference(weight.to(torch.bfloat16)), bias)
        assert got.dtype == torch.bfloat16 and not got[..., 0].float().sub(bias[0]).abs().gt(0.02).any()
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("x_dtype, pairs, int4", [(torch.float32, False, False), (torch.bfloat16, False, False),
                                                  (torch.bfloat16, True, False), (torch.bfloat16, True, True)])
def test_quantized_rows_are_the_same_bits_alone_as_in_any_call_and_in_the_python_body(x_dtype, pairs, int4):
    """Pairs: every row tile widens its int8 pairs to the same bfloat16 pairs; int4: every tile sums each
    block's pairs and enters the block into a column's chain alike, whatever rows it holds (tiles of 3, 2
    and 1). A row's bits are the same in every row count and thread split (the matrix is large enough
    for the kernel to split 23 rows' work between two threads)."""
    if pairs and not cpu_linear.pairs_available() or int4 and not cpu_linear.int4_available():
        pytest.skip("this CPU has no AVX512-BF16")
    out_features, in_features = 2100, 1023
    weight, bias = _weights(out_features, in_features, torch.bfloat16 if pairs else torch.float32)
    packed = cpu_linear.pack(weight, pairs=pairs, int8=not int4, int4=int4)
    assert packed.dim() == (3 if int4 or not pairs else 4)
    x = torch.randn(23, in_features).to(x_dtype)
    every = cpu_linear.linear(x, packed, bias, out_features)
    assert torch.equal(every, cpu_linear._linear(x, packed, bias, out_features))
    _assert_each_row_alone(x, packed, bias, out_features, every, (1, 2, 3, 5, 7, 8, 23))


def _int4_reference(weight: torch.Tensor) -> torch.Tensor:
    """The weights int4 packing computes with: each output's blocks of 32 inputs as s * (q - z), q in 0 .. 15,
    s = (largest - smallest) / 15 (the range stretched to hold zero) rounded to bfloat16, z = round(-smallest / s)."""
    n, k = weight.shape
    w = nn.functional.pad(weight.float(), (0, -k % 32)).view(n, -1, 32)
    low, high = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    s = ((high - low) / 15).to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    z = torch.round(-low / s).clamp(0, 15)
    return (s * ((torch.round(w / s) + z).clamp(0, 15) - z)).view(n, -1)[:, :k]


@pytest.mark.parametrize("out_features, in_features, rows", [(1, 3, 1), (70, 33, 5), (200, 64, 7), (130, 96, 13)])
def test_int4_weights_give_the_product_of_their_blocks(out_features, in_features, rows):
    """packed_weights int4 (a bfloat16 draft): y = x W'^T + bias, W' each block's s * (q - z), summed in
    float32 and rounded once to bfloat16; 0.59 of int8's bytes, the input padded to blocks of 32."""
    if not cpu_linear.int4_available():
        pytest.skip("this CPU has no AVX512-BF16")
    weight, bias = _weights(out_features, in_features, torch.bfloat16)
    weight[0] = 0  # an all-zero output keeps a usable scale
    packed = cpu_linear.pack(weight, int4=True)
    width = cpu_linear._kernel().specserve_gemm_group_width()
    blocks = -(-in_features // 32)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-out_features // width), blocks, 16 * width + 3 * width)
    x = torch.randn(2, rows, in_features).to(torch.bfloat16)
    got = cpu_linear.linear(x, packed, bias.to(torch.bfloat16), out_features)
    want = nn.functional.linear(x.float(), _int4_reference(weight), bias.to(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16 and torch.equal(got[..., 0].float(), want[..., 0].to(torch.bfloat16).float())
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=2e-2)
    # the blocks keep the weights to 1/30 of each block's range
    assert (_int4_reference(weight) - weight.float()).abs().max() <= weight.float().abs().max() / 15


def _assert_each_row_alone(x, packed, bias, out_features, every, row_counts):
    """x's rows in calls of each count, on one thread and on two: the same bits as `every` (all in one call)."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in row_counts:
                for i in range(0, len(x), rows):
                    part = cpu_linear.linear(x[i: i + rows], packed, bias, out_features)
                    assert torch.equal(part, every[i: i + rows]), (n, rows, i)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pairs", [False, True])
def test_bfloat16_results_are_written_as_torch_rounds_the_float32_sums(pairs):
    """A bfloat16 model's linear gets bfloat16 from the kernel, rounded as it writes them: the same bits
    as its float32 results (bias added) converted by torch, ties to even, a NaN and overflow included."""
    if pairs and not cpu_linear.pairs_available():
        pytest.skip("this CPU has no AVX512-BF16")
    weight, bias = _weights(130, 40, torch.bfloat16)
    packed = cpu_linear.pack(weight, pairs=pairs)
    x = torch.randn(9, 40).to(torch.bfloat16)
    x[3, 0], x[4, 1] = float("nan"), 3e38  # a NaN and sums past bfloat16's largest value
    rows = x if pairs else x.float()
    if pairs:
        rows = torch.nn.functional.pad(rows, (0, 0))  # 40 is even: no padding column
    fn = cpu_linear._FUNCTIONS[packed.dtype, packed.dim()]
    wide = torch.empty(9, 130)
    narrow = torch.empty(9, 130, dtype=torch.bfloat16)
    for y, as_bf16 in ((wide, False), (narrow, True)):
        fn(rows.contiguous().data_ptr(), 9, packed.shape[1], packed.data_ptr(), 130, bias.data_ptr(), y.data_ptr(),
           1, as_bf16)
    want = wide.to(torch.bfloat16)
    assert torch.equal(narrow.view(torch.int16), want.view(torch.int16))
    assert want[3].isnan().any() and want[4].isinf().any()  # the special values were reached
    assert torch.equal(cpu_linear.linear(x, packed, bias, 130).view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(not cpu_linear.pairs_available(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("out_features, in_features", [(96, 40), (130, 17), (4096, 576)])
def test_bfloat16_pairs_give_the_product_to_rounding_and_each_row_alone(out_features, in_features):
    """The pair path (bfloat16 rows, vdpbf16ps): F.linear's float32 product to bfloat16 rounding, an odd
    input width padded; a row's result the same bits in every row count and thread split."""
    weight, bias = _weights(out_features, in_features, torch.bfloat16)
    packed = cpu_linear.pack(weight, pairs=True)
    assert packed.dtype == torch.int32 and packed.shape[1] == (in_features + 1) // 2
    x = torch.randn(23, in_features).to(torch.bfloat16)
    got = cpu_linear.linear(x, packed, None, out_features)
    assert got.dtype == torch.bfloat16
    want = nn.functional.linear(x.float(), weight.float()).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)
    _assert_each_row_alone(x, packed, None, out_features, got, (1, 5, 6, 7, 23))


def test_a_bfloat16_model_takes_the_pair_path_where_the_cpu_has_it(target_model):
    model = copy.deepcopy(target_model).to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 30, 2, 17]])
    with torch.inference_mode():
        before = model(ids).logits.float()
        cpu_linear.pack_linears(model)
        after = model(ids).logits.float()
    packed = [m.packed.dtype for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert packed and set(packed) == {torch.int32 if cpu_linear.pairs_available() else torch.bfloat16}
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.8  # bf16 rounding, not a wrong product
    torch.testing.assert_close(after, before, rtol=0.1, atol=0.2)


def test_a_row_is_bit_identical_whatever_rows_share_its_call():
    """A verify's rows against the plain step's one row: every row tile, remainder and thread split
    sums each output in the same order."""
    weight, bias = _weights(300, 130)
    packed = cpu_linear.pack(weight)
    x = torch.randn(23, 130)
    alone = [cpu_linear.linear(x[i : i + 1], packed, bias, 300) for i in range(23)]
    for rows in (2, 5, 6, 7, 12, 23):
        together = cpu_linear.linear(x[:rows], packed, bias, 300)
        for i in range(rows):
            assert torch.equal(together[i], alone[i][0]), (rows, i)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        wide = torch.randn(40, 576)  # a call large enough to be split between threads
        big, big_packed = torch.randn(4096, 576), None
        big_packed = cpu_linear.pack(big)
        split = cpu_linear.linear(wide, big_packed, None, 4096)
        torch.set_num_threads(1)
        assert torch.equal(split, cpu_linear.linear(wide, big_packed, None, 4096))
    finally:
        torch.set_num_threads(threads)


def test_pack_linears_swaps_every_linear_and_keeps_the_logits(target_model, tokenizer):
    model = copy.deepcopy(target_model)
    ids = torch.tensor([[5, 9, 30, 2, 17]])
    with torch.inference_mode():
        before = model(ids).logits
        swapped = cpu_linear.pack_linears(model)
        after = model(ids).logits
    linears = sum(isinstance(m, nn.Linear) for m in target_model.modules())
    assert swapped == linears and not any(type(m) is nn.Linear for m in model.modules())
    assert all(m.kernel for m in model.modules() if isinstance(m, cpu_linear.PackedLinear))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def _siblings(in_features: int, outs: list[int], bias: bool) -> nn.Module:
    parent = nn.Module()
    torch.manual_seed(len(outs) + in_features)
    for name, n in zip(("q_proj", "k_proj", "v_proj"), outs):
        setattr(parent, name, nn.Linear(in_features, n, bias=bias))
    return parent


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("in_features, outs, bias", [(576, [576, 192, 192], False), (72, [72, 24, 24], True),
                                                     (33, [70, 17], False)])
def test_merged_siblings_equal_the_separate_layers_bit_for_bit(dtype, in_features, outs, bias):
    """One kernel call over the stacked weights gives each member's columns as its own layer does, for
    every row count, called in order, out of order or on inputs of their own."""
    parent = _siblings(in_features, outs, bias)
    names = [n for n in ("q_proj", "k_proj", "v_proj") if hasattr(parent, n)]
    separate = {n: cpu_linear.PackedLinear(getattr(parent, n), True, dtype) for n in names}
    assert cpu_linear._merge(parent, tuple(names), True, dtype) == len(names)
    members = {n: getattr(parent, n) for n in names}
    assert all(isinstance(m, cpu_linear.MergedLinear) for m in members.values())
    assert len({id(m.stacked) for m in members.values()}) == 1  # one packed copy of the weights
    for rows in (1, 5, 17):
        x, other = torch.randn(2, rows, in_features), torch.randn(2, rows, in_features)
        for order in (names, names[::-1]):
            for n in order:
                assert torch.equal(members[n](x), separate[n](x)), (n, rows, order)
        for n in names:  # each member on an input of its own: the product computed again for it
            assert torch.equal(members[n](x if n == names[0] else other), separate[n](x if n == names[0] else other))
    assert members[names[0]].last.value is None  # the group's last member drops what it held


def test_merged_siblings_called_from_two_threads_at_once_stay_each_threads_own():
    """A replica's forward thread and its background compile run the same modules: a member never takes
    the product another thread computed for its own input."""
    parent = _siblings(96, [96, 32, 32], False)
    names = ("q_proj", "k_proj", "v_proj")
    separate = {n: cpu_linear.PackedLinear(getattr(parent, n), True) for n in names}
    cpu_linear._merge(parent, names, True, None)
    inputs = [torch.randn(1, 3, 96) for _ in range(2)]
    want = [{n: separate[n](x) for n in names} for x in inputs]
    wrong = []

    def calls(t: int) -> None:
        for _ in range(300):
            for n in names:
                if not torch.equal(getattr(parent, n)(inputs[t]), want[t][n]):
                    wrong.append((t, n))

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:5]


def test_a_runner_on_merged_siblings_gives_the_separate_layers_logits_bit_for_bit(monkeypatch, target_model, tokenizer):
    merged = ModelRunner(copy.deepcopy(target_model), tokenizer, Execution(compile="off", pack=True))
    monkeypatch.setattr(cpu_linear, "MERGED", ())
    separate = ModelRunner(copy.deepcopy(target_model), tokenizer, Execution(compile="off", pack=True))
    layers = target_model.config.num_hidden_layers
    assert sum(isinstance(m, cpu_linear.MergedLinear) for m in merged.model.modules()) == 5 * layers
    assert not any(isinstance(m, cpu_linear.MergedLinear) for m in separate.model.modules())
    assert merged.packed_linears == separate.packed_linears
    context = [5, 9, 30, 2, 17, 40, 41]
    for runner in (merged, separate):
        runner.outs = [runner.forward([SeqInput("s", context, len(context))])[0],  # a prompt
                       runner.forward([SeqInput("s", context + [7], 1)])[0],  # a step
                       runner.forward([SeqInput("s", context + [7, 8, 9, 10], 3)])[0]]  # a verify's rows
    for a, b in zip(merged.outs, separate.outs):
        assert torch.equal(a, b)


def test_compiled_and_eager_steps_run_the_same_linears_and_give_the_same_tokens(target_model, tokenizer):
    """The op runs inside the compiled graph (the runner packs before it compiles): the compiled and the
    eager forward agree to rounding and pick the same tokens."""
    runners = {mode: ModelRunner(copy.deepcopy(target_model), tokenizer,
                                 Execution(compile=mode, compile_max_tokens=8, pack=True)) for mode in ("off", "default")}
    compiled = runners["default"]
    if compiled.steps is None:
        pytest.skip("compiled steps are unavailable here")
    compiled.warm(lambda message: None)
    assert compiled.steps is not None, "the compiled path disagreed with the eager one at warm-up"
    assert compiled.packed_linears == runners["off"].packed_linears > 0
    assert isinstance(compiled.steps.head, cpu_linear.PackedLinear)
    context = [5, 9, 30, 2, 17, 40, 41]
    outs = {}
    for mode, runner in runners.items():
        tokens, ctx = [], list(context)
        for step in range(6):
            rows = 1 + step % 3  # 2 and 3 rows run in the 2- and 4-row graphs: padded, the padding skipped
            logits = runner.forward([SeqInput("s", ctx, rows)])[0]
            tokens += logits.argmax(-1).tolist()
            ctx.append(tokens[-1])
        outs[mode] = tokens
    assert outs["default"] == outs["off"]


def test_within_real_rows_the_padding_is_left_zero_and_the_rows_unchanged():
    weight, bias = _weights(100, 48)
    packed, x = cpu_linear.pack(weight), torch.randn(1, 8, 48)
    full = cpu_linear.linear(x, packed, bias, 100)
    with cpu_linear.real_rows(5):
        padded = cpu_linear.linear(x, packed, bias, 100)
    assert torch.equal(padded[0, :5], full[0, :5]) and not padded[0, 5:].any()
    assert torch.equal(cpu_linear.linear(x, packed, bias, 100), full)  # the limit ends with its block


def test_without_a_compiler_eager_linears_take_onednn_and_compiled_ones_stay(monkeypatch, tmp_path, target_model):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    assert not cpu_linear.kernel_available()
    if not cpu_linear.onednn_available():
        pytest.skip("this torch has no oneDNN")
    assert cpu_linear.pack_linears(copy.deepcopy(target_model), compiled=True) == 0
    model = copy.deepcopy(target_model)
    assert cpu_linear.pack_linears(model) > 0
    assert all(not m.kernel for m in model.modules() if isinstance(m, cpu_linear.PackedLinear))


@pytest.mark.parametrize("packed_dtype, draft_dtype", [(torch.bfloat16, torch.float32), (torch.int8, torch.float32),
                                                      (torch.int4, torch.bfloat16), (torch.int4, torch.float32)])
def test_a_draft_on_smaller_packed_weights_proposes_and_the_output_stays_the_targets(target_model, tokenizer,
                                                                                     packed_dtype, draft_dtype):
    """packed_weights: bfloat16 halves what a float32 draft step streams, int8 quarters it, int4 (a bfloat16
    draft where the CPU has AVX512-BF16; elsewhere int8) takes 0.59 of int8's bytes; its proposals may
    change, the target still decides every token."""
    from app.engine import Engine
    from app.params import SamplingParams

    model = copy.deepcopy(target_model).to(draft_dtype)
    draft = ModelRunner(model, tokenizer, Execution(pack=True, packed_dtype=packed_dtype))
    packed = [m for m in draft.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    int4 = packed_dtype == torch.int4 and draft_dtype == torch.bfloat16 and cpu_linear.int4_available()
    stored = torch.uint8 if int4 else torch.int8 if packed_dtype == torch.int4 else packed_dtype
    assert packed and all(m.packed.dtype == stored for m in packed)
    assert all(m.weights == ("int4" if int4 else str(stored).removeprefix("torch.")) for m in packed)
    engine = Engine(ModelRunner(target_model, tokenizer), draft)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculation={"num_tokens": 4})
    result = engine.generate(["def fib(n):"], params)[0]
    ids = result.prompt_token_ids
    with torch.inference_mode():
        want = target_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=20, min_new_tokens=20, eos_token_id=None,
                                     pad_token_id=0)[0, len(ids):].tolist()
    assert result.token_ids == want
    assert result.speculation["drafted_tokens"] > 0 and result.speculation["accepted_tokens"] > 0


def test_int4_that_the_model_cannot_take_is_said_not_ignored(target_model, caplog):
    """A float32 draft asked for int4 (int4 needs a bfloat16 model with AVX512-BF16) packs int8 and says so;
    one that takes what it asked for says nothing."""
    with caplog.at_level("WARNING", logger="app.model.cpu_linear"):
        cpu_linear.pack_linears(copy.deepcopy(target_model).float(), dtype=torch.int4)
    assert "packed_weights int4: the linears took int8 weights here" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="app.model.cpu_linear"):
        cpu_linear.pack_linears(copy.deepcopy(target_model).float(), dtype=torch.int8)
    assert "packed_weights" not in caplog.text


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_are_a_drafts_setting_alone(weights):
    """A target's weights are the model: its settings and the Serve config refuse int8 and int4; a draft's
    take them."""
    from app.config import DraftSettings, ModelSettings
    from deployments.args import AppConfig

    assert DraftSettings(packed_weights=weights).packed_weights == weights
    assert AppConfig.model_validate({"draft": {"packed_weights": weights}}).draft.packed_weights == weights
    for refused in (lambda: ModelSettings(packed_weights=weights),
                    lambda: AppConfig.model_validate({"target": {"packed_weights": weights}})):
        with pytest.raises(ValueError):
            refused()


def test_the_linears_benchmark_times_every_linear_of_a_model_both_ways(tmp_path):
    """`python -m specserve.bench.kv --model DIR --linears 1,5`: each row count timed through the kernel
    and F.linear, with the kernel's read rate over the model's linear weights."""
    from conftest import make_model
    from specserve.bench.kv import linears

    make_model(seed=0).save_pretrained(tmp_path)
    out = linears(str(tmp_path), [1, 5], repeats=1)
    assert list(out) == [1, 5]
    for row in out.values():
        assert set(row) == {"kernel", "F.linear", "kernel GB/s"} and all(v > 0 for v in row.values())


def test_the_step_benchmark_times_each_graph_length_on_the_paged_path(tmp_path, tokenizer):
    """`python -m specserve.bench.kv --model DIR --compile-layers 1,2`: a whole forward of 1 and 5 rows for
    each number of layers a compiled graph runs (the setting compile_layers), interleaved."""
    from conftest import make_model
    from specserve.bench.kv import steps

    make_model(seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    out = steps(str(tmp_path), "default", sequences=2, keys=8, repeats=2, compile_layers=[1, 2])
    assert list(out) == ["1 row per sequence", "5 rows per sequence"]
    for row in out.values():
        assert list(row) == ["1 layers a graph", "2 layers a graph"] and all(v > 0 for v in row.values())


def test_a_packed_runner_holds_no_tensor_of_the_checkpoints_file_mapping(tmp_path, tokenizer):
    """Loaded from safetensors, a model's tensors are views of the file's mapping; once its linears are
    packed, what is left (embedding, norms) is copied out, so the mapping, every page packing read, can go."""
    from app.model.runner import load_model
    from conftest import make_model

    make_model(seed=5).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype="float32")
    mapped = {name: p.data_ptr() for name, p in model.named_parameters()}
    runner = ModelRunner(model, tok, Execution(pack=True))
    assert runner.packed_linears > 0
    left = dict(model.named_parameters())
    assert left and all(p.data_ptr() != mapped[name] for name, p in left.items())
    fresh = make_model(seed=5)
    assert torch.equal(left["model.embed_tokens.weight"], fresh.model.embed_tokens.weight)


@pytest.mark.parametrize("march, cpu_flag", [("x86-64-v3", "avx2"), ("x86-64-v4", "avx512f")])
def test_the_kernel_builds_and_computes_for_cpus_without_the_newest_instructions(march, cpu_flag):
    """A user's CPU may lack AVX512-BF16 or AVX-512: the kernel built for AVX2 alone (x86-64-v3) and for AVX-512
    without BF16 (x86-64-v4) compiles, and where this CPU runs it, its float32 and int8 products are
    F.linear's to rounding. (An int8 path once needed a header only the BF16 build included.)"""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86 instruction sets")
    path = native.build(cpu_linear.SOURCE, [f for f in cpu_linear._FLAGS if not f.startswith("-march")]
                        + [f"-march={march}"])
    assert path is not None, f"the kernel does not build for {march}"
    if cpu_flag not in open("/proc/cpuinfo").read().split():
        return  # built; this CPU cannot run it
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.specserve_gemm_f32, lib.specserve_gemm_q8):
        fn.argtypes, fn.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64], None
    for fn in (lib.specserve_gemm_pack_f32, lib.specserve_gemm_pack_q8):
        fn.argtypes, fn.restype = [ptr, i64, i64, ptr], None
    lib.specserve_gemm_group_width.restype = lib.specserve_gemm_q4_block.restype = i64
    assert lib.specserve_gemm_q4_block() == 0  # int4 blocks need AVX512-BF16: none in this build
    width = lib.specserve_gemm_group_width()
    weight, bias = _weights(70, 33)
    x = torch.randn(9, 33)
    packed = torch.empty(-(-70 // width), 33, width)
    lib.specserve_gemm_pack_f32(weight.data_ptr(), 70, 33, packed.data_ptr())
    y = torch.empty(9, 70)
    lib.specserve_gemm_f32(x.data_ptr(), 9, 33, packed.data_ptr(), 70, bias.data_ptr(), y.data_ptr(), 1, 0)
    torch.testing.assert_close(y, nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    q8 = cpu_linear._pack_int8(lib, weight, width, pairs=False)
    rows = nn.functional.pad(x, (0, cpu_linear.SCALE_ROWS))
    lib.specserve_gemm_q8(rows.data_ptr(), 9, q8.shape[1], q8.data_ptr(), 70, bias.data_ptr(), y.data_ptr(), 1, 0)
    torch.testing.assert_close(y, nn.functional.linear(x, _int8_reference(weight), bias), rtol=1e-5, atol=1e-4)
