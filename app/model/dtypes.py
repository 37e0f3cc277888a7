"""Which float type a device computes in: bfloat16 where its matmuls run natively, float32 elsewhere.

A CPU without native bf16 (x86 without AVX512-BF16 or AMX, ARM without BF16; a common cloud shape)
runs torch's bf16 matmuls in a scalar fallback, 50-100x slower than float32. Flags lie (oneDNN may
report bf16 support it only emulates, a VM may hide an extension), so the CPU is measured: one small
bf16 and one float32 matmul, timed once per process. `SPECSERVE_NATIVE_BF16=1|0` overrides the
measurement (for a reproducible run, or a test).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

log = logging.getLogger(__name__)

NATIVE_SPEEDUP = 1.2  # bf16 counts as native where its matmul beats float32's by this much
_PROBE_N = 256  # [256, 256] @ [256, 256]: 34 MFLOP, well under a millisecond where bf16 is native
NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _best_seconds(a: torch.Tensor, b: torch.Tensor, reps: int, budget_s: float) -> float:
    """The fastest of up to `reps` timed a @ b, stopping once `budget_s` is spent (a fallback is slow)."""
    a @ b  # warm-up: allocator, kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return best


def cpu_speedup(dtype: torch.dtype = torch.bfloat16) -> float:
    """float32 matmul time over `dtype` matmul time on this CPU, measured once per process and dtype
    (bf16: about 2-4 where native, about 0.01 in torch's scalar fallback)."""
    return _probe(dtype)  # one cache key per dtype: `cpu_speedup()` and `cpu_speedup(bf16)` measured once


@functools.cache
def _probe(dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(_PROBE_N, _PROBE_N, generator=gen) for _ in range(2))
    fp32 = _best_seconds(a, b, reps=5, budget_s=0.05)
    half = _best_seconds(a.to(dtype), b.to(dtype), reps=5, budget_s=0.05)
    log.info("%s matmul probe: %.2fx float32's speed on this CPU (capability %s)", dtype, fp32 / half,
             torch.backends.cpu.get_cpu_capability())
    return fp32 / half


def native(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
           speedup: float | None = None) -> bool:
    """Does `device` run `dtype` (a half type) matmuls natively? `speedup` injects the CPU's
    measurement (tests)."""
    device = torch.device(device)
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # the accelerators torch supports (xpu, mps, hpu) do half types in hardware
    forced = os.environ.get("SPECSERVE_NATIVE_BF16") if dtype == torch.bfloat16 else None
    if speedup is None and forced in ("0", "1"):
        return forced == "1"
    return (cpu_speedup(dtype) if speedup is None else speedup) >= NATIVE_SPEEDUP


def native_bf16(device: str | torch.device = "cpu", speedup: float | None = None) -> bool:
    """Does `device` run bf16 matmuls natively?"""
    return native(device, torch.bfloat16, speedup)


def compute_dtype(device: str | torch.device = "cpu", speedup: float | None = None) -> torch.dtype:
    """The dtype to train and run in on `device`: bfloat16 where native, else float32."""
    return torch.bfloat16 if native_bf16(device, speedup) else torch.float32


def resolve(name: str, device: str | torch.device = "cpu", checkpoint: torch.dtype | None = None,
            speedup: float | None = None) -> torch.dtype:
    """The dtype to load weights in for a configured `name` ("auto", "float32", "bfloat16", "float16").

    "auto" takes the checkpoint's dtype where the device computes it natively, else float32 (a bf16
    checkpoint on a CPU without native bf16 is served in float32). An explicit half type the device
    only emulates is honoured with a warning that names the cost.
    """
    if name != "auto" and name not in NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(NAMES)}")
    device = torch.device(device)
    wanted = NAMES.get(name, checkpoint or torch.float32)
    if wanted == torch.float32 or native(device, wanted, speedup):
        return wanted
    if name == "auto":
        return torch.float32
    log.warning("%s on this CPU (capability %s) has no native matmul: torch runs it in a scalar "
                "fallback, often 50x slower than float32; use dtype float32 or auto",
                name, torch.backends.cpu.get_cpu_capability())
    return wanted
