"""The dtype rule: bf16 only where the device does bf16 matmuls natively, measured, with the measurement
injected here so that every branch runs on any machine."""

from __future__ import annotations

import logging

import pytest
import torch

from app.model import dtypes
from app.model.runner import load_model
from tests.conftest import make_model

FALLBACK, NATIVE = 0.01, 3.0  # bf16 matmul speed over float32's: torch's scalar fallback, AMX


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("SPECSERVE_NATIVE_BF16", raising=False)


def test_native_is_decided_by_the_measured_speed():
    assert not dtypes.native_bf16("cpu", speedup=FALLBACK)
    assert not dtypes.native_bf16("cpu", speedup=1.0)  # emulated bf16, no faster than float32
    assert dtypes.native_bf16("cpu", speedup=NATIVE)
    assert dtypes.compute_dtype("cpu", speedup=FALLBACK) == torch.float32
    assert dtypes.compute_dtype("cpu", speedup=NATIVE) == torch.bfloat16


def test_the_probe_is_a_ratio_of_timed_matmuls(monkeypatch):
    seconds = {torch.float32: 0.002, torch.bfloat16: 0.2}  # bf16 100x slower: the fallback
    monkeypatch.setattr(dtypes, "_best_seconds", lambda a, b, reps, budget_s: seconds[a.dtype])
    dtypes._probe.cache_clear()
    try:
        assert dtypes.cpu_speedup() == pytest.approx(0.01)
        assert not dtypes.native_bf16("cpu")
    finally:
        dtypes._probe.cache_clear()


def test_the_probe_runs_on_this_machine(monkeypatch):
    """One measurement decides, however it is asked for: a second one (the cache keyed on how the
    dtype was passed) read 5.3x once and below 1.2x the next time on a busy machine."""
    speedup = dtypes.cpu_speedup()
    assert speedup > 0 and dtypes.native_bf16("cpu") == (speedup >= dtypes.NATIVE_SPEEDUP)
    monkeypatch.setattr(dtypes, "_best_seconds", lambda *a, **k: pytest.fail("measured again"))
    assert dtypes.cpu_speedup(torch.bfloat16) == dtypes.cpu_speedup(dtype=torch.bfloat16) == speedup


def test_the_environment_overrides_the_probe(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_speedup", lambda dtype=torch.bfloat16: pytest.fail("probed"))
    monkeypatch.setenv("SPECSERVE_NATIVE_BF16", "0")
    assert dtypes.compute_dtype("cpu") == torch.float32
    monkeypatch.setenv("SPECSERVE_NATIVE_BF16", "1")
    assert dtypes.compute_dtype("cpu") == torch.bfloat16


def test_cuda_asks_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # e.g. a T4
    assert dtypes.compute_dtype("cuda") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert dtypes.compute_dtype("cuda") == torch.bfloat16
    assert dtypes.resolve("auto", "cuda", torch.float16) == torch.float16


def test_auto_takes_the_checkpoints_dtype_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_speedup", lambda dtype=torch.bfloat16: pytest.fail("probed"))
    assert dtypes.resolve("auto", "cpu", torch.float32) == torch.float32  # no probe needed
    assert dtypes.resolve("auto", "cpu", None) == torch.float32
    assert dtypes.resolve("float32", "cpu") == torch.float32
    assert dtypes.resolve("auto", "cpu", torch.bfloat16, speedup=FALLBACK) == torch.float32
    assert dtypes.resolve("auto", "cpu", torch.bfloat16, speedup=NATIVE) == torch.bfloat16
    assert dtypes.resolve("auto", "cpu", torch.float16, speedup=FALLBACK) == torch.float32


def test_asking_for_bf16_without_it_warns_of_the_cost(caplog):
    with caplog.at_level(logging.WARNING, logger="app.model.dtypes"):
        assert dtypes.resolve("bfloat16", "cpu", speedup=FALLBACK) == torch.bfloat16  # honoured
    assert "scalar fallback" in caplog.text and "float32 or auto" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="app.model.dtypes"):
        dtypes.resolve("bfloat16", "cpu", speedup=NATIVE)
    assert caplog.text == ""


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtypes.resolve("fp8", "cpu")


@pytest.mark.parametrize("native", ["0", "1"])
def test_loading_a_bf16_checkpoint_with_auto(native, monkeypatch, tmp_path, tokenizer):
    make_model(seed=3, layers=1).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("SPECSERVE_NATIVE_BF16", native)
    model, _ = load_model(str(tmp_path), dtype="auto")
    assert model.dtype == (torch.bfloat16 if native == "1" else torch.float32)
