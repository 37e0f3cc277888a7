"""Paged attention on a CPU: one call per layer for a ragged batch's spans.

Decode steps and verify rows are a few query rows per sequence against hundreds or thousands of
cached keys. torch's CPU attention (SDPA's flash kernel) is built for many rows: per sequence it
costs about 9 us before it reads a key and then runs below the memory's speed (one row over 400
keys, 4 heads x 64: 58 us, where reading those keys takes about 20). FlexAttention, nested tensors
and a compiled gather measured slower still (docs/architecture.md, "CPU attention"). So a span's
attention is a small C++ kernel (app/model/kernels/paged_attention.cpp): every span of the layer in one
call, each row's keys and values read through its block table where they lie. Prompt chunks take it too,
though SDPA's blocked kernel computes long ones faster: SDPA's sums depend on the call's shape, so a
prompt position's keys would differ in their last bits with its chunking, and a sequence's output with
what was cached before it (docs/architecture.md, "Batch invariance").

The kernel is compiled once per machine for its own instruction set (app/model/native.py), for pools
of float32 or bfloat16 (widened as read, summed in float32, each output rounded once). No compiler
(the same need as compiled steps), a build that fails, or a pool of another dtype: None, and
attention stays torch's, one call per sequence.

Math flags: -ffast-math vectorises the exponentials and the sums (glibc's vector expf); it is
given to the compile step alone (app/model/native.py says why).

The op's CPU kernel is C++ too where it builds (app/model/kernels/attention_op.cpp, with torch's
headers): for a forward `bind` tells it about (its spans, the pool's dtype), it calls the kernel
with no Python in between; for any other it calls the op's Python body (app/model/ragged.py `attend`).
"""

import ctypes
import threading

import torch

from app.model import native
from app.model.kv import BLOCK_SIZE

SOURCE = "paged_attention.cpp"  # in app/model/kernels/, built by app/model/native.py
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c++17"]


_KERNELS = {torch.float32: "specserve_paged_attention_f32", torch.bfloat16: "specserve_paged_attention_bf16"}


def kernel(dtype: torch.dtype = torch.float32):
    """The loaded kernel for a pool of `dtype` (a ctypes function), or None where it cannot be built.
    Built once a process."""
    lib = native.load(SOURCE, _FLAGS)
    if lib is None or dtype not in _KERNELS:
        return None
    fn = getattr(lib, _KERNELS[dtype])
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, i64]
    fn.restype = None
    return fn


def usable(pool_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a pool of this dtype on this device can take the kernel (building it if need be); the first
    time it can, the op's C++ CPU kernel is registered too (where it builds)."""
    if device.type != "cpu" or kernel(pool_dtype) is None:
        return False
    if "impl" not in _op:
        _register()
    return True


OP_SOURCE = "attention_op.cpp"  # the op's CPU kernel in C++ (its Python body where this does not build)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C++ op's code for a pool's dtype
_registered = threading.Lock()
_op: dict[str, object] = {}  # "impl": "C++" or "Python" once registered; "bind", "unbind": the C++ setters


def _register() -> None:
    """Load the op's C++ CPU kernel (its load registers it with torch's dispatcher), else keep the Python body."""
    with _registered:
        if "impl" in _op:
            return
        lib = native.load_op(OP_SOURCE, _FLAGS)
        if lib is None:
            _op["impl"] = "Python"
            return
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.specserve_attention_bind.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64]
        lib.specserve_attention_bind.restype = lib.specserve_attention_unbind.restype = None
        _op.update(impl="C++", bind=lib.specserve_attention_bind, unbind=lib.specserve_attention_unbind)


def implementation() -> str | None:
    """Which body specserve::ragged_attention runs on a CPU: "C++", "Python", or None before it was asked for."""
    return _op.get("impl")


def bind(spans: "Spans | None", pool) -> None:
    """Tell the C++ op what the forward this thread runs next is: `spans` over `pool` (an app.model.blocks.BlockPool),
    where they are every span of the forward and the pool holds float32 or bfloat16; else (None, another
    forward) nothing, so that each of its calls takes the op's Python body. The forward's tensors must
    outlive its binding: the op reads them by address."""
    if _op.get("impl") != "C++":
        return
    keys = pool.keys[0] if pool is not None else None
    if spans is None or not spans.every or keys is None or keys.dtype not in _DTYPES or keys.device.type != "cpu":
        _op["unbind"]()
        return
    heads_kv, slots, dim = keys.shape
    _op["bind"](spans.meta.data_ptr(), spans.count, spans.tables.data_ptr(), pool.addresses.data_ptr(),
                len(pool.keys), heads_kv, dim, slots, BLOCK_SIZE, _DTYPES[keys.dtype])


class Spans:
    """A forward's spans in the kernel's terms, built once per forward and read by every layer:
    their rows, positions and block tables as int64 tensors."""

    def __init__(self, spans: list, every: bool = False):  # app.model.ragged.Span
        self.every = every  # the forward's every span: the kernel writes their new keys and values too
        meta, tables = [], []
        for s in spans:
            meta += [s.offset, s.length, s.start, len(tables)]
            tables += s.entry.blocks[: -(-(s.start + s.length) // BLOCK_SIZE)]
        self.count = len(spans)
        self.meta = torch.tensor(meta, dtype=torch.int64)
        self.tables = torch.tensor(tables or [0], dtype=torch.int64)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
               scale: float, new: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write the spans' rows of `out` ([1, T, Hq, D]) from `query` ([1, Hq, T, D]) over one layer's
        pool (`keys`, `values`: [Hkv, slots, D], contiguous). `new`: the row's new keys and values ([1, Hkv,
        T, D] each), which the kernel writes into the spans' slots first (one call instead of two indexed
        copies a layer, ~60 us of a 1.7 ms layer of the reference target at 1 row); None: already in the pool."""
        if query.stride(-1) != 1:
            query = query.contiguous()
        heads_kv, slots, dim = keys.shape
        new_k = new_v = None
        if new is not None:
            new_k, new_v = new
            if new_k.stride(-1) != 1 or new_v.stride() != new_k.stride():
                new_k, new_v = new_k.contiguous(), new_v.contiguous()
        kernel(keys.dtype)(query.data_ptr(), query.stride(1), query.stride(2), keys.data_ptr(), values.data_ptr(),
                           out.data_ptr(), None if new_k is None else new_k.data_ptr(),
                           None if new_v is None else new_v.data_ptr(), 0 if new_k is None else new_k.stride(1),
                           0 if new_k is None else new_k.stride(2), self.meta.data_ptr(), self.count,
                           self.tables.data_ptr(), query.shape[1], heads_kv, dim, slots, BLOCK_SIZE, scale,
                           torch.get_num_threads())
