"""Linear layers with weights packed once for the CPU kernel that suits serving.

A decode step or a verify multiplies 1 to ~100 rows by every weight of the model, so on a CPU its
linears run at the speed the weights stream from memory. `nn.Linear`'s kernels are built for many
rows and stream well below it: on the reference target's matrices (2-core AMD EPYC, one thread,
float32, 1 row) `F.linear` read 9 to 13 GB/s and oneDNN's prepacked weights 11 to 12 GB/s, where
the core reads 23 GB/s. So the small-row linear is a C++ kernel (app/model/kernels/small_gemm.cpp, built
by app/model/native.py) over weights packed into column groups that each stream contiguously: 16 to 22
GB/s at 1 row on the same matrices.

Its op, `specserve::linear`, runs eager and inside the compiled steps alike (inductor keeps it as
an opaque call), so compiled and eager forwards compute the same linears. Every output is one chain
of fused multiply-adds over the inputs in order, whatever the number of rows: a verify's rows equal
the plain steps' bit for bit.

Where the kernel cannot be built (no compiler), eager forwards fall back on oneDNN's prepacked
weights (torch ships that kernel for its compiler's weight-freezing pass) and compiled ones keep
inductor's matmuls, which cannot lower the oneDNN op.
"""

import ctypes
import threading
from contextlib import contextmanager

import torch
from torch import nn

from app.model import native

SOURCE = "small_gemm.cpp"  # in app/model/kernels/, built by app/model/native.py
# no -ffast-math: reassociated sums would make a row's result depend on the tile it runs in
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-std=c++17"]
_PACKABLE = (torch.float32, torch.bfloat16)
PACK_ROWS = 16  # the row count oneDNN lays the fallback's weights out for


def _kernel() -> ctypes.CDLL | None:
    lib = native.load(SOURCE, _FLAGS)
    if lib is not None and lib.specserve_gemm_f32.restype is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.specserve_gemm_f32, lib.specserve_gemm_bf16):
            fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64]
            fn.restype = None
        for fn in (lib.specserve_gemm_pack_f32, lib.specserve_gemm_pack_bf16):
            fn.argtypes = [ptr, i64, i64, ptr]
            fn.restype = None
        lib.specserve_gemm_group_width.restype = i64
    return lib


_FUNCTIONS: dict[torch.dtype, object] = {}  # weights' dtype -> the kernel's function


def kernel_available() -> bool:
    """Whether this machine built the small-row kernel."""
    lib = _kernel()
    if lib is not None and not _FUNCTIONS:
        _FUNCTIONS.update({torch.float32: lib.specserve_gemm_f32, torch.bfloat16: lib.specserve_gemm_bf16})
    return lib is not None


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (the fallback)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], float32 or bfloat16) in the kernel's layout: [groups, in, group width]."""
    kernel_available()  # loads the kernel and names its functions, which `linear` then calls
    lib = _kernel()
    weight = weight.detach().contiguous()
    width = lib.specserve_gemm_group_width()
    out = torch.empty(-(-weight.shape[0] // width), weight.shape[1], width, dtype=weight.dtype)
    fn = lib.specserve_gemm_pack_f32 if weight.dtype == torch.float32 else lib.specserve_gemm_pack_bf16
    fn(weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


# Defined through torch.library.Library rather than torch.library.custom_op: a step makes one call per
# linear (211 on the reference target), and custom_op's wrappers cost about 20 us a call against 5.
_LIBRARY = torch.library.Library("specserve", "FRAGMENT")
_LIBRARY.define("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] @ W^T + bias -> [..., out_features] in x's dtype, W packed by `pack`. The kernel
    computes in float32 (bfloat16 inputs and weights widen exactly) and the result is rounded once."""
    wide = x.dtype == torch.float32  # the common case, with no conversion: a step makes 211 of these calls
    rows = x if wide and x.is_contiguous() else x.to(torch.float32).contiguous()
    count = rows.numel() // rows.shape[-1]
    real = min(count, getattr(_local, "rows", None) or count)
    # a compiled step's padding rows (past `real`) come out zero, uncomputed
    y = (torch.empty if real == count else torch.zeros)(*x.shape[:-1], out_features, dtype=torch.float32)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    fn = _FUNCTIONS[packed.dtype]
    fn(rows.data_ptr(), real, rows.shape[-1], packed.data_ptr(), out_features,
       None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y if wide else y.to(x.dtype)


_LIBRARY.impl("linear", _linear, "CPU")

_local = threading.local()  # the real row count of the compiled step this thread runs


@contextmanager
def real_rows(count: int):
    """Within: the linears compute the first `count` rows of their input alone. A compiled step pads its
    row to a bucket (app/model/compiled.py: 80 verify rows run in the 128-row graph); at a few rows a linear
    streams its weights, but at tens of rows it is bound by arithmetic, which padding would waste."""
    before = getattr(_local, "rows", None)
    _local.rows = count
    try:
        yield
    finally:
        _local.rows = before


@torch.library.register_fake("specserve::linear")
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


linear = torch.ops.specserve.linear.default


class PackedLinear(nn.Module):
    """y = x W^T + b on packed weights: the small-row kernel's, or oneDNN's where it is missing."""

    def __init__(self, layer: nn.Linear, kernel: bool, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.kernel = kernel
        weight = layer.weight.detach()
        if kernel and dtype is not None:  # the kernel reads bfloat16 weights against float32 rows
            weight = weight.to(dtype)
        # oneDNN's batch-size hint only picks the blocked layout; any row count runs on it, but the layout
        # oneDNN picks for 1 row is slow for every row count (demo target, 1 core: 1 row 5.6 ms vs 4.3,
        # 5 rows 8.9 vs 4.7); from 4 up the hints measure alike
        packed = pack(weight) if kernel else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        self.register_buffer("packed", packed, persistent=False)
        bias = None if layer.bias is None else layer.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if self.kernel:
            return linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        kind = "small-row kernel" if self.kernel else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


def pack_linears(model: nn.Module, compiled: bool = False, dtype: torch.dtype | None = None) -> int:
    """Replace every CPU float32/bfloat16 nn.Linear of `model` by a PackedLinear; returns how many.

    Inference only (the packed weights take no gradients). Leaves the model alone where no packed
    kernel fits: the weights live on another device, or (`compiled`: the forward is a compiled graph)
    only oneDNN's op is at hand, which inductor cannot lower. `dtype` (bfloat16): the small-row
    kernel's weights in it, rounded once, half the bytes a step streams (`packed_weights`).
    """
    kernel = kernel_available()
    if not kernel and (compiled or not onednn_available()):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in _PACKABLE:
                setattr(parent, name, PackedLinear(child, kernel, dtype))
                count += 1
    return count
