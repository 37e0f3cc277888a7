"""Linear layers with weights packed once for the CPU kernel that suits serving.

A decode step or a verify multiplies 1 to ~100 rows by every weight of the model, so on a CPU its
linears run at the speed the weights stream from memory. `nn.Linear`'s kernels are built for many
rows and stream well below it: on the reference target's matrices (2-core AMD EPYC, one thread,
float32, 1 row) `F.linear` read 9 to 13 GB/s and oneDNN's prepacked weights 11 to 12 GB/s, where
the core reads 23 GB/s. So the small-row linear is a C++ kernel (app/model/kernels/small_gemm.cpp, built
by app/model/native.py) over weights packed into column groups that each stream contiguously: 16 to 22
GB/s at 1 row on the same matrices.

Its op, `specserve::linear`, runs eager and inside the compiled steps alike (inductor keeps it as
an opaque call), so compiled and eager forwards compute the same linears. Its CPU kernel is C++
(app/model/kernels/linear_op.cpp) where that builds, else `_linear` below, the same steps in Python.
Every output is one chain of fused multiply-adds over the inputs in order, whatever the number of
rows: a verify's rows equal the plain steps' bit for bit.

A bfloat16 model's linears, on a CPU with AVX512-BF16, take the kernel's pair path: its weights packed
in pairs along the input dimension and its bfloat16 rows multiplied by vdpbf16ps, two products per
lane an instruction (app/model/kernels/small_gemm.cpp). At tens of rows a step is bound by arithmetic,
and the widening path (float32 FMAs) is: on the reference target's 576 x 49152 head, one thread,
64 rows 45 ms -> 19 ms, 16 rows 11.7 -> 6.9, 1 row 3.7 -> 3.2. Its sums are a chain of pairs, the same
for every row count (rows still equal bit for bit), rounded as that instruction rounds.

Where the kernel cannot be built (no compiler), eager forwards fall back on oneDNN's prepacked
weights (torch ships that kernel for its compiler's weight-freezing pass) and compiled ones keep
inductor's matmuls, which cannot lower the oneDNN op.
"""

import ctypes
import logging
import threading
from contextlib import contextmanager

import torch
from torch import nn

from app.model import native

log = logging.getLogger(__name__)

SOURCE = "small_gemm.cpp"  # in app/model/kernels/, built by app/model/native.py
# no -ffast-math: reassociated sums would make a row's result depend on the tile it runs in
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-std=c++17"]
_PACKABLE = (torch.float32, torch.bfloat16)
PACK_ROWS = 16  # the row count oneDNN lays the fallback's weights out for


def _kernel() -> ctypes.CDLL | None:
    lib = native.load(SOURCE, _FLAGS)
    if lib is not None and lib.specserve_gemm_f32.restype is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.specserve_gemm_f32, lib.specserve_gemm_bf16, lib.specserve_gemm_pairs, lib.specserve_gemm_q8,
                   lib.specserve_gemm_q8_pairs, lib.specserve_gemm_q4):
            fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64]  # ..., y, threads, y is bfloat16
            fn.restype = None
        for fn in (lib.specserve_gemm_pack_f32, lib.specserve_gemm_pack_bf16, lib.specserve_gemm_pack_pairs,
                   lib.specserve_gemm_pack_q8, lib.specserve_gemm_pack_q8_pairs):
            fn.argtypes = [ptr, i64, i64, ptr]
            fn.restype = None
        lib.specserve_gemm_group_width.restype = i64
        lib.specserve_gemm_has_pairs.restype = i64
        lib.specserve_gemm_q4_block.restype = i64
    return lib


# packed weights' (dtype, dimensions) -> the kernel's function: float32, bfloat16, int8 [groups, in, width];
# pairs (int32), int4 blocks (uint8) [groups, ..., width or block bytes]; int8 pairs [groups, in / 2, width, 2]
_FUNCTIONS: dict[tuple[torch.dtype, int], object] = {}
OP_SOURCE = "linear_op.cpp"  # the op's CPU kernel in C++ (its Python body, `_linear`, where it cannot build)
_registered = threading.Lock()
_op: dict[str, object] = {}  # "impl": "C++" or "Python" once registered; "rows": the C++ real-rows setter


def kernel_available() -> bool:
    """Whether this machine built the small-row kernel; the first call registers the op's CPU kernel."""
    lib = _kernel()
    if lib is not None and not _FUNCTIONS:
        _FUNCTIONS.update({(torch.float32, 3): lib.specserve_gemm_f32, (torch.bfloat16, 3): lib.specserve_gemm_bf16,
                           (torch.int32, 3): lib.specserve_gemm_pairs, (torch.int8, 3): lib.specserve_gemm_q8,
                           (torch.int8, 4): lib.specserve_gemm_q8_pairs, (torch.uint8, 3): lib.specserve_gemm_q4})
    if lib is not None and "impl" not in _op:
        _register()
    return lib is not None


def _register() -> None:
    """specserve::linear's CPU kernel: the C++ one (app/model/kernels/linear_op.cpp, the same kernels without
    the Python body and ctypes call, ~6 us a call), else `_linear`."""
    with _registered:
        if "impl" in _op:
            return
        lib = native.load_op(OP_SOURCE, _FLAGS)
        if lib is None:
            _LIBRARY.impl("linear", _linear, "CPU")
            _op["impl"] = "Python"
            return
        lib.specserve_linear_real_rows.argtypes, lib.specserve_linear_real_rows.restype = [ctypes.c_int64], None
        _op.update(impl="C++", rows=lib.specserve_linear_real_rows)


def implementation() -> str | None:
    """Which body specserve::linear runs on a CPU: "C++", "Python", or None before the kernel was asked for."""
    return _op.get("impl")


def pairs_available() -> bool:
    """Whether the kernel has its bfloat16 pair path here (the CPU and the compiler have AVX512-BF16)."""
    return kernel_available() and bool(_kernel().specserve_gemm_has_pairs())


def int4_available() -> bool:
    """Whether the kernel has its int4 path here (the pair path, and AVX-512's byte shuffles)."""
    return pairs_available() and _kernel().specserve_gemm_q4_block() > 0


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (the fallback)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


SCALE_ROWS = 4  # an int8 group's k-rows after its weights: its columns' float32 scales (small_gemm.cpp)
SCALE_PAIRS = 2  # the same bytes in int8 pairs: two pair rows
Q4_K = 32  # int4: inputs a scale and zero point cover (small_gemm.cpp)


def pack(weight: torch.Tensor, pairs: bool = False, int8: bool = False, int4: bool = False) -> torch.Tensor:
    """`weight` ([out, in], float32 or bfloat16) in the kernel's layout: [groups, in, group width];
    `pairs` (bfloat16 weights, pairs_available()): [groups, in / 2 rounded up, group width] int32, each
    two bfloat16 values along the input, for bfloat16 rows; `int8`: [groups, in + SCALE_ROWS, group width]
    int8, each output's weights rounded to int8 steps of its own scale (its largest magnitude / 127), the
    group's scales after them as float32 bytes; `int8` and `pairs`: the same steps in pairs along the input,
    for bfloat16 rows, [groups, in / 2 rounded up + SCALE_PAIRS, group width, 2] (each 16 columns of a pair
    row: their even inputs' bytes, then their odd ones'; small_gemm.cpp); `int4` (int4_available()): each
    output's weights in blocks of Q4_K inputs as a bfloat16 scale times (q - z), q and z in 0 .. 15,
    [groups, blocks, block bytes] uint8 (small_gemm.cpp)."""
    kernel_available()  # loads the kernel and names its functions, which `linear` then calls
    lib = _kernel()
    weight = weight.detach().contiguous()
    width, (n, k) = lib.specserve_gemm_group_width(), weight.shape
    if int4:
        return _pack_int4(weight.float(), width, lib.specserve_gemm_q4_block())
    if int8:
        return _pack_int8(lib, weight.float(), width, pairs)
    if pairs:
        out = torch.empty(-(-n // width), (k + 1) // 2, width, dtype=torch.int32)
        lib.specserve_gemm_pack_pairs(weight.to(torch.bfloat16).data_ptr(), n, k, out.data_ptr())
        return out
    out = torch.empty(-(-n // width), k, width, dtype=weight.dtype)
    fn = lib.specserve_gemm_pack_f32 if weight.dtype == torch.float32 else lib.specserve_gemm_pack_bf16
    fn(weight.data_ptr(), n, k, out.data_ptr())
    return out


def _pack_int8(lib, weight: torch.Tensor, width: int, pairs: bool) -> torch.Tensor:
    n, k = weight.shape
    groups = -(-n // width)
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero output: any scale
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    scales = torch.zeros(groups * width, dtype=torch.float32)  # past n: the zero columns' scales
    scales[:n] = scale
    if pairs:
        steps = (k + 1) // 2
        weights = torch.empty(groups, steps, width, 2, dtype=torch.int8)
        lib.specserve_gemm_pack_q8_pairs(q.data_ptr(), n, k, weights.data_ptr())
        out = torch.empty(groups, steps + SCALE_PAIRS, width, 2, dtype=torch.int8)
        out[:, :steps] = weights
        out[:, steps:] = scales.view(torch.int8).view(groups, SCALE_PAIRS, width, 2)
        return out
    weights = torch.empty(groups, k, width, dtype=torch.int8)
    lib.specserve_gemm_pack_q8(q.data_ptr(), n, k, weights.data_ptr())
    out = torch.empty(groups, k + SCALE_ROWS, width, dtype=torch.int8)
    out[:, :k] = weights
    out[:, k:] = scales.view(torch.int8).view(groups, SCALE_ROWS, width)
    return out


def _q4_columns(width: int) -> torch.Tensor:
    """The column each byte of an int4 pair row holds: small_gemm.cpp's unpacking leaves byte
    16 * (l / 4) + 4 * j + l % 4 of a row in lane l of its vector j, which is column 16 * j + l."""
    lanes = 16
    assert width == 4 * lanes, "int4 blocks are laid out for AVX-512's 16 lanes, 4 vectors a group"
    columns = torch.empty(width, dtype=torch.long)
    for c in range(width):
        j, lane = divmod(c, lanes)
        columns[16 * (lane // 4) + 4 * j + lane % 4] = c
    return columns


def _pack_int4(weight: torch.Tensor, width: int, block_bytes: int) -> torch.Tensor:
    n, k = weight.shape
    groups, blocks = -(-n // width), -(-k // Q4_K)
    w = torch.zeros(groups * width, blocks * Q4_K)  # zero past n and k: those products add nothing
    w[:n, :k] = weight
    w = w.view(groups * width, blocks, Q4_K)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)  # zero within the range: z is exact
    scale = ((high - low) / 15).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale
    zero = torch.round(-low / scale.float()).clamp_(0, 15)
    q = (torch.round(w / scale.float()[..., None]) + zero[..., None]).clamp_(0, 15).to(torch.uint8)
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # a byte: the even input's q in its low nibble
    pairs = pairs.view(groups, width, blocks, Q4_K // 2).permute(0, 2, 3, 1)[..., _q4_columns(width)]
    scales = scale.view(groups, width, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    zeros = zero.to(torch.uint8).view(groups, width, blocks).transpose(1, 2)
    out = torch.cat([pairs.reshape(groups, blocks, -1), scales, zeros], -1).contiguous()
    assert out.shape[-1] == block_bytes
    return out


# Defined through torch.library.Library rather than torch.library.custom_op: a step makes one call per
# linear (121 on the reference target), and custom_op's wrappers cost about 20 us a call against 5.
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] @ W^T + bias -> [..., out_features] in x's dtype, W packed by `pack`. The kernel
    sums in float32 (bfloat16 inputs and weights widen exactly; pairs: bfloat16 rows against pairs of
    weights) and the result is rounded once, by the kernel as it writes it (to x's dtype)."""
    wide = x.dtype == torch.float32  # the common case, with no conversion: a step makes 121 of these calls
    fn = _FUNCTIONS[packed.dtype, packed.dim()]
    if packed.dtype == torch.uint8:  # int4 blocks: bfloat16 rows, zeros against the padding (none: strided)
        rows = torch.nn.functional.pad(x.to(torch.bfloat16), (0, Q4_K * packed.shape[1] - x.shape[-1])).contiguous()
    elif packed.dim() == 4:  # int8 pairs: bfloat16 rows, zeros against the padding and the scales
        rows = torch.nn.functional.pad(x.to(torch.bfloat16), (0, 2 * packed.shape[1] - x.shape[-1]))
    elif packed.dtype == torch.int32:  # pairs: a bfloat16 model's rows are bfloat16 already
        rows = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
        if rows.shape[-1] % 2:  # the weights' input dimension is padded to even with zero
            rows = torch.nn.functional.pad(rows, (0, 1))
    else:
        rows = x if wide and x.is_contiguous() else x.to(torch.float32).contiguous()
        if packed.dtype == torch.int8:  # zeros against the scale rows
            rows = torch.nn.functional.pad(rows, (0, SCALE_ROWS))
    count = rows.numel() // rows.shape[-1]
    real = min(count, getattr(_local, "rows", None) or count)
    # a compiled step's padding rows (past `real`) come out zero, uncomputed
    out = torch.float32 if wide else torch.bfloat16 if x.dtype == torch.bfloat16 else None
    y = (torch.empty if real == count else torch.zeros)(*x.shape[:-1], out_features, dtype=out or torch.float32)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    fn(rows.data_ptr(), real, packed.shape[1], packed.data_ptr(), out_features,
       None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(), out == torch.bfloat16)
    return y if out else y.to(x.dtype)  # float16 rows: the kernel writes float32


_local = threading.local()  # the real row count of the compiled step this thread runs


@contextmanager
def real_rows(count: int):
    """Within: the linears compute the first `count` rows of their input alone. A compiled step pads its
    row to a bucket (app/model/compiled.py: 80 verify rows run in the 128-row graph); at a few rows a linear
    streams its weights, but at tens of rows it is bound by arithmetic, which padding would waste."""
    before = getattr(_local, "rows", None)
    _local.rows = count
    native_rows = _op.get("rows")  # the C++ kernel's own, thread-local as this
    if native_rows is not None:
        native_rows(count)
    try:
        yield
    finally:
        _local.rows = before
        if native_rows is not None:
            native_rows(before or 0)


@torch.library.register_fake("specserve::linear")
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


linear = torch.ops.specserve.linear.default


class PackedLinear(nn.Module):
    """y = x W^T + b on packed weights: the small-row kernel's, or oneDNN's where it is missing."""

    def __init__(self, layer: nn.Linear, kernel: bool, dtype: torch.dtype | None = None,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """`weight` and `bias` given: these instead of the layer's (whose sizes they have)."""
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.kernel = kernel
        if weight is None:
            weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
        # a bfloat16 model (its rows bfloat16 too) on a CPU with AVX512-BF16: the pair path (int8 ones too)
        pairs = kernel and weight.dtype == torch.bfloat16 and pairs_available()
        # a draft's weights in int4 blocks (`packed_weights: int4`) where the pair path has them, else int8
        int4 = pairs and dtype == torch.int4 and int4_available()
        int8 = kernel and dtype in (torch.int8, torch.int4) and not int4
        stored = dtype if kernel and dtype is not None else weight.dtype  # oneDNN's: the model's own
        self.weights = "int4" if int4 else "int8" if int8 else str(stored).removeprefix("torch.")
        if kernel and dtype is not None and not (int8 or int4):  # bfloat16 weights against float32 rows
            weight = weight.to(dtype)
        # oneDNN's batch-size hint only picks the blocked layout; any row count runs on it, but the layout
        # oneDNN picks for 1 row is slow for every row count (demo target, 1 core: 1 row 5.6 ms vs 4.3,
        # 5 rows 8.9 vs 4.7); from 4 up the hints measure alike
        packed = pack(weight, pairs, int8, int4) if kernel else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if self.kernel:
            return linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        kind = f"small-row kernel, {self.weights} weights" if self.kernel else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


# Sibling linears that their parent calls in this order on one input: the kernel computes them in one call
# over their weights stacked, as vLLM's merged QKV and gate-up layers do. A small matrix streams below the
# memory's rate and every call costs ~15 us of dispatch (one thread, 2-core EPYC without AVX-512, per layer:
# the reference target's q, k, v 279 -> 209 us, gate and up 619 -> 578 us in float32; its draft's q, k, v
# 142 -> 83 us, gate and up 194 -> 165 us in bfloat16).
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Last:
    """The stacked product a merged group computed last: (input, output), or None. One tuple, read and
    replaced whole, so a thread that finds another thread's pair sees an input that is not its own."""

    def __init__(self):
        self.value = None


class MergedLinear(nn.Module):
    """One of a group of sibling linears that read the same input (MERGED): the first to be called
    computes the whole group's outputs in one kernel call over the stacked weights, the others take
    their columns of it. Each column is the same chain of multiply-adds in the stacked matrix as in its
    own, so the outputs equal the separate layers' bit for bit. Called on another input, or out of
    order, a member computes the stack itself again: slower, never wrong."""

    def __init__(self, stacked: PackedLinear, last: _Last, start: int, end: int, first: bool, final: bool):
        super().__init__()
        self.stacked = stacked  # shared by the group's members (its buffers counted once)
        self.last, self.start, self.end, self.first, self.final = last, start, end, first, final
        self.in_features, self.out_features = stacked.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = None if self.first else self.last.value
        if pair is None or pair[0] is not x:
            pair = (x, self.stacked(x))
        self.last.value = None if self.final else pair  # nothing held past the group's last member
        return pair[1][..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of {self.stacked.out_features}"


def _merge(parent: nn.Module, names: tuple[str, ...], kernel: bool, dtype: torch.dtype | None) -> int:
    """Replace `parent`'s linears `names` by MergedLinear members over their stacked weights, where
    all are CPU nn.Linear layers of one input size, dtype and bias kind; returns how many."""
    layers = [getattr(parent, n, None) for n in names]
    if not all(type(lay) is nn.Linear for lay in layers):
        return 0
    first = layers[0]
    same = all(lay.in_features == first.in_features and lay.weight.dtype == first.weight.dtype
               and lay.weight.device.type == "cpu" and (lay.bias is None) == (first.bias is None) for lay in layers)
    if not same or first.weight.dtype not in _PACKABLE:
        return 0
    weight = torch.cat([lay.weight.detach() for lay in layers])
    bias = None if first.bias is None else torch.cat([lay.bias.detach() for lay in layers])
    stacked = PackedLinear(nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta"),
                           kernel, dtype, weight=weight, bias=bias)
    last, start = _Last(), 0
    for i, (name, lay) in enumerate(zip(names, layers)):
        setattr(parent, name, MergedLinear(stacked, last, start, start + lay.out_features, i == 0,
                                           i == len(names) - 1))
        start += lay.out_features
    return len(names)


def pack_linears(model: nn.Module, compiled: bool = False, dtype: torch.dtype | None = None) -> int:
    """Replace every CPU float32/bfloat16 nn.Linear of `model` by a PackedLinear (siblings that read
    one input, MERGED, by members of one stacked PackedLinear); returns how many were replaced.

    Inference only (the packed weights take no gradients). Leaves the model alone where no packed
    kernel fits: the weights live on another device, or (`compiled`: the forward is a compiled graph)
    only oneDNN's op is at hand, which inductor cannot lower. `dtype` (bfloat16): the small-row
    kernel's weights in it, rounded once, half the bytes a step streams (`packed_weights`); int8: each
    output's weights in int8 steps of its own scale, a quarter of float32's bytes (a draft's alone: it
    changes the model's outputs).
    """
    kernel = kernel_available()
    if not kernel and (compiled or not onednn_available()):
        return 0
    count = 0
    for parent in list(model.modules()):
        if kernel:  # oneDNN's blocking may depend on the stacked size: its outputs are not shown equal
            count += sum(_merge(parent, names, kernel, dtype) for names in MERGED)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in _PACKABLE:
                setattr(parent, name, PackedLinear(child, kernel, dtype))
                count += 1
    wanted = str(dtype).removeprefix("torch.")
    taken = {m.weights for m in model.modules() if isinstance(m, PackedLinear)}
    if dtype in (torch.int8, torch.int4) and taken and taken != {wanted}:  # said, not silently ignored
        log.warning("packed_weights %s: the linears took %s weights here (int8 needs the small-row kernel, int4 a "
                    "bfloat16 model on a CPU with AVX512-BF16)", wanted, ", ".join(sorted(taken)))
    return count


@torch.no_grad()
def own_unpacked(model: nn.Module) -> None:
    """Copy the parameters that packing left (embeddings, norms, biases) out of the checkpoint's file.

    Why: transformers maps a safetensors checkpoint and its tensors are views of that mapping. Packing
    reads every linear's weight, so the whole file's pages become resident, and one tensor left in the
    mapping (the embedding) keeps all of it mapped: a bfloat16 Qwen2.5-Coder-1.5B replica held 6.3 GiB for
    3.3 GiB of weights, the file beside its packed copy. Owned copies let the mapping go (3.85 GiB)."""
    for param in model.parameters():  # a tied parameter once
        if param.device.type == "cpu":
            param.data = param.data.clone()

