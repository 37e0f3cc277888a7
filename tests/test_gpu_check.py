"""`make gpu-check` runs its whole code path here, at smoke sizes on the CPU, and fails when a check fails."""

import json

import pytest
import torch

from specserve.gpu import check as gpu_check


def test_the_gpu_check_runs_end_to_end_at_smoke_sizes(tmp_path):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identity_fp32"]["identical"] == report["identity_fp32"]["prompts"] > 0
    assert report["sampling"]["chi2_pvalue"] > 1e-4
    served = report["served_path"]["modes"]
    assert set(served) == {"off", "default"} and served["default"]["compiled"]  # reduce-overhead: CUDA only
    assert all(m["identical"] == report["served_path"]["batch"] and m["prefix_hit_tokens"] > 0 for m in served.values())
    production = report["production_path"]  # loaded as a replica loads, compiled, recompiles an error once warm
    assert production["compiled"] and production["identical_rerun"] == production["requests"]
    assert production["kv_tokens"] >= 2048 and production["rounds"] > 0
    paths = report["attention"]["paths"]  # the GPU's attention paths: varlen here through its reference
    assert set(paths) == {"per_sequence", "varlen"} and all(p["identical"] == 4 for p in paths.values())
    tp = report["tensor_parallel"]  # two ranks over gloo, loaded and started as a replica's rank workers
    assert all(tp[n]["identical"] == tp["sequences"] for n in ("tp1", "tp2"))
    assert all(0 < tp[n]["accepted_per_round"] <= 2 for n in ("tp1", "tp2"))  # rounds accept, reject and recover
    bench = report["benchmark"]
    assert set(bench["costs_by_batch"]) == {"1", "8", "32"} and bench["c"] > 0
    assert set(bench["tokens_per_s"]) == {"speculative K=4", "speculative auto", "HF generate", "HF assisted K=4"}


def test_a_difference_from_generate_fails_the_check(monkeypatch, tmp_path):
    real = gpu_check.run_engine

    def off_by_one(engine, ids, mode, n):
        run = real(engine, ids, mode, n)
        run.tokens[3] = (run.tokens[3] + 1) % 512
        return run

    monkeypatch.setattr(gpu_check, "run_engine", off_by_one)
    out = tmp_path / "report.json"  # the identity step alone: the end-to-end run is the test above
    assert gpu_check.main(["--device", "cpu", "--smoke", "--only", "identity_fp32", "--json", str(out)]) == 1
    identity = json.loads(out.read_text())["identity_fp32"]
    assert not identity["ok"] and identity["failed"] and identity["identical"] < identity["prompts"]


def test_a_rank_that_differs_from_generate_fails_the_tensor_parallel_step(monkeypatch):
    from specserve.gpu import tp as gpu_tp

    real = gpu_tp._ranks

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out["tokens"][0][5] = (out["tokens"][0][5] + 1) % 512
        return out

    monkeypatch.setattr(gpu_tp, "_ranks", off_by_one)
    report = gpu_tp.check_tensor_parallel("cpu", torch.float32, smoke=True)
    assert not report["ok"] and [f["position"] for f in report["tp2"]["failed"]] == [5]
    assert report["tp1"]["identical"] == report["sequences"]


def test_tensor_parallel_is_skipped_plainly_with_one_gpu(monkeypatch):
    from specserve.gpu import tp as gpu_tp

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_tp.check_tensor_parallel("cuda", torch.bfloat16, smoke=False) == {
        "ok": True, "skipped": "needs 2 GPUs; this machine has 1"}


def test_no_gpu_is_said_plainly(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_cpu_without_native_bf16_skips_the_bf16_check_and_benchmarks_in_float32(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_NATIVE_BF16", "0")
    monkeypatch.setattr(gpu_check, "check_identity", lambda dtype, device, smoke: (
        pytest.fail("bf16 identity run without native bf16") if dtype == torch.bfloat16
        else {"ok": True, "prompts": 1, "identical": 1}))
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--only", "identity_fp32,identity_bf16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "no native bf16" in report["identity_bf16"]["skipped"]
    seen = []

    def llama(layers, hidden, vocab, seed, dtype, device):
        seen.append(dtype)
        raise RuntimeError("stop before building a 1B model")

    monkeypatch.setattr(gpu_check, "llama", llama)
    with pytest.raises(RuntimeError, match="stop before"):
        gpu_check.benchmark("cpu", smoke=False)  # the full-size benchmark picks its dtype by the rule
    assert seen == [torch.float32]



def test_isolated_steps_run_apart_and_one_past_its_limit_is_stopped_and_reported(tmp_path, capsys):
    """--isolate: each step in its own process, the report written after every step; a step that
    outruns its limit (here 1 ms, shorter than any interpreter's start) is stopped, said and failed."""
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--only", "sampling", "--isolate", "600",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["sampling"]["ok"] and report["sampling"]["draws"] > 0
    assert gpu_check.main(["--device", "cpu", "--smoke", "--only", "sampling,attention", "--isolate", "0.001",
                           "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert [report[s]["ok"] for s in ("sampling", "attention")] == [False, False]
    assert "stopped after its 0.001 s" in report["attention"]["error"]
    assert "FAILED: sampling, attention" in capsys.readouterr().out


def test_a_rerun_may_differ_only_at_a_near_tie_and_never_in_float32():
    """The production path's rerun check: in float32 any greedy difference fails; a seeded sampled
    request that differs is counted (its drafts may differ between runs), never passed as identical."""
    from types import SimpleNamespace

    from app.params import SamplingParams

    model = gpu_check.llama(2, 64, 512, 1, torch.float32, "cpu")
    ids = gpu_check.prompts(2, 12, 512)
    greedy, seeded = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0.8, seed=3, max_tokens=4)
    run = lambda *tokens: [SimpleNamespace(token_ids=list(t)) for t in tokens]
    same = gpu_check.rerun_differences(model, ids, [greedy, seeded], run([5, 6, 7], [8, 9]), run([5, 6, 7], [8, 9]))
    assert same["identical_rerun"] == 2 and not same["rerun_failed"]
    differ = gpu_check.rerun_differences(model, ids, [greedy, seeded], run([5, 6, 7], [8, 9]), run([5, 6, 1], [8, 2]))
    assert differ["identical_rerun"] == 0 and differ["seeded_differing"] == 1
    assert [d["position"] for d in differ["rerun_failed"]] == [2] and not differ["rerun_near_ties"]
