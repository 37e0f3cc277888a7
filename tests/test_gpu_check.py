"""`make gpu-check` runs its whole code path here, at smoke sizes on the CPU, and fails when a check fails."""

import json

from app import gpu_check


def test_the_gpu_check_runs_end_to_end_at_smoke_sizes(tmp_path):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identity_fp32"]["identical"] == report["identity_fp32"]["prompts"] > 0
    assert report["sampling"]["chi2_pvalue"] > 1e-4
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
    assert gpu_check.main(["--device", "cpu", "--smoke"]) == 1


def test_no_gpu_is_said_plainly(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
