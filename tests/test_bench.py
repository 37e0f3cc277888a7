"""The in-process benchmark on the tiny pair: every mode and key present and sane, plot written,
a greedy mismatch of one of our modes fails the run."""

import argparse
import json

import pytest
import torch

from specserve.bench import inprocess

KEYS = ["output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms", "tau", "acceptance_rate", "alpha",
        "acceptance_by_position", "mean_k", "c_measured", "c_estimator", "bound", "speedup", "efficiency",
        "identical", "mismatches"]


def cli_args(model_dirs, tmp_path, *extra) -> argparse.Namespace:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def fib(n):\\n", "id": "fib"}\nhello world, this is a prompt\n')
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "float32",
            "--prompts", str(prompts), "--max-tokens", "8", "--no-progress", *extra]
    return inprocess.add_bench_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_every_mode_reports_every_key(model_dirs, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = cli_args(model_dirs, tmp_path, "--json", str(out_json), "--plot", str(out_png))
    assert inprocess.bench_cli(args) == 0
    report = json.loads(out_json.read_text())
    assert set(report["modes"]) == set(inprocess.MODES)
    assert report["identity_passed"] is True
    for name, row in report["modes"].items():
        assert set(KEYS) <= set(row), name
        assert row["output_tokens"] == 2 * 8, name  # EOS ignored everywhere: lengths agree
        assert row["output_tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p99"] >= row["tpot_ms"]["p50"]
        if not inprocess.MODES[name].hf:
            assert row["identical"], name
            assert all(0.0 <= a <= 1.0 for a in row["acceptance_by_position"])
    for name in ["spec-k2", "spec-k4", "spec-k6"]:
        row = report["modes"][name]
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and 0.0 <= row["alpha"] <= 1.0
        assert row["bound"] > 0 and row["efficiency"] > 0 and row["c_estimator"] > 0
        assert 1 <= len(row["acceptance_by_position"]) <= int(name[-1])
    assert report["modes"]["target"]["speedup"] == 1.0
    assert report["modes"]["target"]["mean_k"] == 0.0
    assert report["costs"]["c"] > 0
    # host syncs of a steady round, counted: one per verify batch, one read per draft call (its tokens)
    # and the copies of its tokens, q ids and q probabilities
    # and uploads: a draft forward's indices once per step (5: four tokens and the guess) and the
    # proposal's values once; the target's forward once, and sampled its four kinds of inputs once each
    assert report["syncs"]["greedy"] == {"propose": 4, "verify": 1, "propose_uploads": 6, "verify_uploads": 1}
    assert report["syncs"]["sampled"] == {"propose": 4, "verify": 1, "propose_uploads": 7, "verify_uploads": 5}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "spec-auto" in printed and "host syncs per round" in printed


def test_a_mismatch_of_our_modes_fails_the_run(model_dirs, tmp_path, monkeypatch, capsys):
    from specserve.bench import runs

    real = runs.run_engine

    def corrupt(engine, ids, mode, max_tokens):
        run = real(engine, ids, mode, max_tokens)
        if mode.name == "spec-k4":
            run.tokens[-1] = (run.tokens[-1] + 1) % engine.target.vocab_size
        return run

    monkeypatch.setattr(runs, "run_engine", corrupt)
    args = cli_args(model_dirs, tmp_path, "--modes", "spec-k2,spec-k4", "--plot", "")
    assert inprocess.bench_cli(args) == 1
    err = capsys.readouterr().err
    assert "spec-k4" in err and "'fib'" in err and "output token 7" in err


def test_bad_options_are_refused(model_dirs, tmp_path, capsys):
    assert inprocess.bench_cli(cli_args(model_dirs, tmp_path, "--modes", "target,k9")) == 2
    assert "k9" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ('{"prompt": "a b", "id": "x"}\n\nplain line\n', (["a b", "plain line"], ["x", "2"])),
])
def test_prompts_file_formats(tmp_path, text, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    assert inprocess.load_prompts(str(path), None) == expected
    assert inprocess.load_prompts(str(path), 1) == (expected[0][:1], expected[1][:1])


def test_prefill_bench_reports_both_modes(model_dirs, capsys):
    from specserve.bench import prefill

    threads = str(torch.get_num_threads())  # leave the suite's setting as it was
    assert prefill.main(["--target", model_dirs["target"], "--streams", "2", "--prompt-tokens", "150",
                               "--chunk", "32", "--threads", threads]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report) == {"whole", "chunks of 32"}
    for row in report.values():  # figures only: how they compare is the machine's business
        assert row["gap_max_ms"] >= row["gap_p50_ms"] > 0 and row["long_request_s"] > 0


def test_draft_ahead_is_off_in_process_unless_asked(model_dirs, tmp_path):
    assert inprocess._load(cli_args(model_dirs, tmp_path)).policy.ahead is False
    assert inprocess._load(cli_args(model_dirs, tmp_path, "--draft-ahead")).policy.ahead is True


def test_constraint_bench_reports_each_constraint(tmp_path, capsys):
    from serving import save_tiny_pair
    from specserve.bench import constraint

    target, draft = save_tiny_pair(tmp_path, byte_level=True, special_tokens=["[TOOL_CALLS]"])
    assert constraint.main(["--target", target, "--draft", draft, "--prompts", "2", "--max-tokens", "12",
                                  "--tool-parser", "mistral"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report) == ["none", "json_object", "regex", "tool call (mistral, forced)"]
    for row in report.values():  # figures only: what they are is the pair's business
        assert 0.0 <= row["acceptance"] <= 1.0 and row["tokens"] > 0


def test_the_identity_check_counts_every_answer_and_says_where_one_parts():
    """specserve.bench.identity against a stand-in server whose speculative answer to one prompt, sent
    four at a time, parts from its plain one at character 3: 16 of 17 identical, that one named."""
    from specserve.bench import identity

    sent = []

    def post(path, body):
        sent.append((path, body["speculation"]))
        spec = body["speculation"] != {"enabled": False}
        if path == "/v1/chat/completions":
            return {"choices": [{"message": {"content": "a generator yields"}}]}
        text = "def x(): pass" if body["prompt"] != identity.PROMPTS[2] else "abcdef"
        if spec and body["prompt"] == identity.PROMPTS[2] and len(sent) > 2 * len(identity.PROMPTS):
            text = "abcXef"  # the four-at-a-time pass
        return {"choices": [{"text": text}], "speculation": {"rounds": 3} if spec else None}

    lines = []
    assert identity.compare(post, "m", 8, 4, say=lines.append) == (16, 17)
    assert [line for line in lines if "parts at" in line] == [lines[len(identity.PROMPTS) + 2]]
    assert "parts at 3" in lines[len(identity.PROMPTS) + 2]
    assert {spec["num_tokens"] for _, spec in sent if "num_tokens" in spec} == {4}
    assert sum(spec == {"enabled": False} for _, spec in sent) == len(identity.PROMPTS) + 1


def test_the_steps_bench_reports_each_shape_eagerly(model_dirs, capsys):
    """specserve.bench.steps on the tiny target with compile off: the eager row only, every shape a
    positive median, and the same figures as JSON on the last line."""
    from specserve.bench import steps

    assert steps.main(["--target", model_dirs["target"], "--dtype", "float32", "--compile", "off", "--reps", "3",
                       "--context", "20"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report) == ["eager"] and set(report["eager"]) == set(steps.SHAPES)
    assert all(ms > 0 for ms in report["eager"].values())
    with pytest.raises(SystemExit):
        steps.main(["--target", model_dirs["target"], "--reps", "1"])
    with pytest.raises(SystemExit):  # a target's weights are the model
        steps.main(["--target", model_dirs["target"], "--packed-weights", "int8"])


def test_the_steps_bench_loads_a_draft_as_a_draft_replica_does(model_dirs, capsys, monkeypatch):
    """--draft: the model's linears packed in --packed-weights (here int8), as a draft replica's are."""
    from app.model import cpu_linear
    from specserve.bench import steps

    if not cpu_linear.kernel_available():
        pytest.skip("no C++ compiler to build the kernel")
    loaded = []
    real = steps.load_runner
    monkeypatch.setattr(steps, "load_runner", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    assert steps.main(["--draft", model_dirs["draft"], "--dtype", "float32", "--compile", "off", "--reps", "2",
                       "--context", "10", "--packed-weights", "int8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report) == ["eager"] and all(ms > 0 for ms in report["eager"].values())
    packed = [m for m in loaded[0].model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert packed and all(m.packed.dtype == torch.int8 for m in packed)
