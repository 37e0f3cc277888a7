"""The HTTP benchmark against the app on the tiny pair: every mode x concurrency reported and sane,
the identity check passes, plot written; a differing output of one mode fails the run."""

import argparse
import json

import pytest

from specserve.bench import http_sweep, inprocess
from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow

MODES = ["target", "spec-auto", "spec-k2"]
KEYS = ["concurrency", "requests", "output_tokens", "output_tokens_per_s", "per_stream_tokens_per_s", "ttft_ms",
        "tpot_ms", "itl_ms", "tau", "acceptance_rate", "mean_k", "fallback_rounds", "max_target_batch_size",
        "speedup", "identical", "mismatches"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    with running_app(target, draft, compiled=False) as base:
        yield base


def cli_args(url, tmp_path, *extra) -> argparse.Namespace:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def fib(n):\\n", "id": "fib"}\nhello world, this is a prompt\n')
    argv = ["--url", url, "--prompts", str(prompts), "--concurrency", "1,2", "--max-tokens", "8",
            "--modes", ",".join(MODES), "--no-progress", *extra]
    return inprocess.add_bench_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_sweep_reports_every_mode_and_level(url, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert http_sweep.url_cli(cli_args(url, tmp_path, "--json", str(out_json), "--plot", str(out_png))) == 0
    report = json.loads(out_json.read_text())
    assert report["identity_passed"] is True
    assert list(report["modes"]) == MODES and report["config"]["concurrency"] == [1, 2]
    for name, rows in report["modes"].items():
        assert set(rows) == {"1", "2"}, name
        for row in rows.values():
            assert set(KEYS) <= set(row), name
            assert row["requests"] == 2 and row["output_tokens"] == 2 * 8  # EOS ignored: full lengths
            assert row["output_tokens_per_s"] > 0 and row["per_stream_tokens_per_s"] > 0
            assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p99"] >= row["tpot_ms"]["p50"]
            assert row["tau"] >= 1.0 and row["identical"] and row["max_target_batch_size"] >= 1
    assert all(r["speedup"] == 1.0 and r["mean_k"] == 0.0 for r in report["modes"]["target"].values())
    for row in report["modes"]["spec-k2"].values():
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and 0 < row["mean_k"] <= 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "spec-auto" in capsys.readouterr().out


def test_a_differing_output_fails_the_run(url, tmp_path, monkeypatch, capsys):
    real = http_sweep.stream_completion

    async def corrupt(client, model, prompt, index, mode, max_tokens):
        run = await real(client, model, prompt, index, mode, max_tokens)
        if mode == "spec-k2" and index == 0:
            run.text = ("@" if run.text.startswith("#") else "#") + run.text[1:]
        return run

    monkeypatch.setattr(http_sweep, "stream_completion", corrupt)
    assert http_sweep.url_cli(cli_args(url, tmp_path, "--plot", "")) == 1
    err = capsys.readouterr().err
    assert "spec-k2 at concurrency 1" in err and "'fib'" in err and "character 0" in err


def test_bad_options_are_refused(tmp_path, capsys):
    url = "http://127.0.0.1:9"  # refused before any request
    assert http_sweep.url_cli(cli_args(url, tmp_path, "--modes", "target,hf-target")) == 2
    assert "hf-target" in capsys.readouterr().err
    assert http_sweep.url_cli(cli_args(url, tmp_path, "--concurrency", "0,2")) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_an_unreachable_server_is_an_error_not_a_traceback(tmp_path, capsys):
    assert http_sweep.url_cli(cli_args("http://127.0.0.1:9", tmp_path)) == 1
    assert "cannot reach" in capsys.readouterr().err
