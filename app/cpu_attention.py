"""Paged attention on a CPU: one call per layer for a ragged batch's short spans.

Decode steps and verify rows are a few query rows per sequence against hundreds or thousands of
cached keys. torch's CPU attention (SDPA's flash kernel) is built for many rows: per sequence it
costs about 9 us before it reads a key and then runs below the memory's speed (one row over 400
keys, 4 heads x 64: 58 us, where reading those keys takes about 20). FlexAttention, nested tensors
and a compiled gather measured slower still (docs/architecture.md, "CPU attention"). So a short
span's attention is a small C++ kernel (app/kernels/paged_attention.cpp): every short span of the
layer in one call, each row's keys and values read through its block table where they lie.

The kernel is compiled here, once per machine, with the machine's own instruction set
(`-march=native`: the binary is cached under a key of the source, the compiler and the CPU's
flags, never shared between different CPUs) and loaded with ctypes, which releases the GIL while
it runs. No compiler (the same need as compiled steps), a build that fails, or a pool that is not
float32: None, and attention stays torch's, one call per sequence.

Math flags: -ffast-math vectorises the exponentials and the sums (glibc's vector expf) and is
given to the compile step alone; linked with it, GCC would add a start-up object that turns on
flush-to-zero for the whole process and change every other kernel's results.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from app.kv import BLOCK_SIZE

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_attention.cpp"
MAX_ROWS = 8  # spans up to this many new rows take the kernel; longer ones (prompts) torch's SDPA
_SYMBOL = "specserve_paged_attention_f32"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "kernel": the ctypes function or None, once tried


def _cpu_key() -> str:
    """What the binary depends on besides its source: the machine's ISA flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve", "kernels")
    return Path(root)


def build() -> Path | None:
    """The kernel's shared library, compiled if this machine has none yet; None when it cannot be."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        log.info("paged CPU attention: no C++ compiler; attention is one SDPA call per sequence")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(_FLAGS), _cpu_key()]).encode())
        lib = _cache_dir() / f"paged_attention-{key.hexdigest()[:20]}.so"
        if lib.exists():
            return lib
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # replicas may build at once: rename atomically
            obj, out = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
            subprocess.run([cxx, *_FLAGS, "-c", str(SOURCE), "-o", obj], check=True, capture_output=True, timeout=300)
            subprocess.run([cxx, "-shared", "-pthread", obj, "-o", out, "-lm"], check=True, capture_output=True,
                           timeout=300)
            os.replace(out, lib)
        return lib
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("paged CPU attention: build failed (%s %s); attention is one SDPA call per sequence", e,
                    detail.decode(errors="replace")[-500:])
        return None


def kernel():
    """The loaded kernel (a ctypes function), or None where it cannot be built. Built once a process."""
    with _lock:
        if "kernel" not in _loaded:
            lib, fn = build(), None
            if lib is not None:
                fn = getattr(ctypes.CDLL(str(lib)), _SYMBOL)
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                               i64]
                fn.restype = None
            _loaded["kernel"] = fn
        return _loaded["kernel"]


def usable(pool_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a pool of this dtype on this device can take the kernel (building it if need be)."""
    return device.type == "cpu" and pool_dtype == torch.float32 and kernel() is not None


class Spans:
    """A forward's short spans in the kernel's terms, built once per forward and read by every layer:
    their rows, positions and block tables as int64 tensors."""

    def __init__(self, spans: list):  # app.ragged.Span
        meta, tables = [], []
        for s in spans:
            meta += [s.offset, s.length, s.start, len(tables)]
            tables += s.entry.blocks[: -(-(s.start + s.length) // BLOCK_SIZE)]
        self.count = len(spans)
        self.meta = torch.tensor(meta, dtype=torch.int64)
        self.tables = torch.tensor(tables or [0], dtype=torch.int64)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
               scale: float) -> None:
        """Write the spans' rows of `out` ([1, T, Hq, D]) from `query` ([1, Hq, T, D]) over one layer's
        pool (`keys`, `values`: [Hkv, slots, D], contiguous)."""
        if query.stride(-1) != 1:
            query = query.contiguous()
        heads_kv, slots, dim = keys.shape
        kernel()(query.data_ptr(), query.stride(1), query.stride(2), keys.data_ptr(), values.data_ptr(),
                 out.data_ptr(), self.meta.data_ptr(), self.count, self.tables.data_ptr(), query.shape[1], heads_kv,
                 dim, slots, BLOCK_SIZE, scale, torch.get_num_threads())
