"""`specserve plan`: every shipped manifest and Serve config fits its devices, in the JSON a check reads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specserve import plan

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "k8s").glob("ray-service.*.yaml")) + [
    "cluster/serve_config.yaml", "cluster/examples/serve_config.gpu-8b.yaml"]
EIGHT_B_GPUS = ["--gpu", "TargetServer=NVIDIA-H100-80GB-HBM3", "--gpu", "DraftServer=NVIDIA-L4"]


def run_plan(*args: str) -> subprocess.CompletedProcess:
    """`specserve plan ARGS` as its command runs it: in a process of its own."""
    return subprocess.run([sys.executable, "-m", "specserve.cli", "plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def plan_here(*args: str) -> subprocess.CompletedProcess:
    """The same command line through the CLI's main, in this process (a process of its own spends ~10 s
    importing torch and transformers on 2 cores); its exit status and what it printed."""
    import contextlib
    import io
    import os

    from specserve import cli

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["plan", *args])
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("path", FILES)
def test_every_shipped_file_fits_and_prints_the_keys_a_check_reads(path):
    done = plan_here(path, "--json", *(EIGHT_B_GPUS if "gpu-8b" in path else []))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    assert [r["name"] for r in rows] == ["DraftServer", "TargetServer"]
    for r in rows:
        assert tuple(r) == plan.KEYS
        assert r["fits"] and r["kv_tokens"] >= r["max_model_len"] > 0
        assert r["model_config"]["num_attention_heads"] > 0  # a real config, heads and all
        if "gpu" in path:
            assert r["weights_bytes"] + r["working_bytes"] + r["kv_bytes"] + plan.RUNTIME_BYTES <= 0.9 * r["gpu_bytes"] + 1


def test_the_gpu_manifest_reads_the_pools_gpus_and_shards_the_target_four_ways():
    rows = {r.name: r for r in plan.plan_file(str(ROOT / "k8s/ray-service.gpu.yaml"))}
    target, draft = rows["TargetServer"], rows["DraftServer"]
    assert (target.gpu, draft.gpu) == ("NVIDIA-H100-80GB-HBM3", "NVIDIA-L4")
    assert target.tensor_parallel_size == 4 and target.max_model_len == draft.max_model_len == 131072
    # 70.6B parameters in bf16, all sharded by transformers' plan (embedding by rows, head by vocabulary)
    assert 32 * 2**30 < target.weights_bytes < 34 * 2**30
    assert 2.2 * 2**30 < draft.weights_bytes < 2.4 * 2**30  # 1.24B with a tied head, whole


def test_a_replica_that_does_not_fit_makes_the_plan_fail_and_says_why(tmp_path):
    config = yaml.safe_load((ROOT / "cluster/examples/serve_config.gpu-8b.yaml").read_text())
    config["applications"][0]["args"]["target"]["model"] = "meta-llama/Llama-3.1-70B-Instruct"  # on one L4
    path = tmp_path / "too-big.yaml"
    path.write_text(yaml.safe_dump(config))
    done = plan_here(str(path), "--gpu", "TargetServer=NVIDIA-L4", "--gpu", "DraftServer=NVIDIA-L4")
    assert done.returncode == 1
    assert "NO: nothing left for the KV cache" in done.stdout
    config["applications"][0]["args"]["target"].update(model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=600_000)
    path.write_text(yaml.safe_dump(config))
    done = plan_here(str(path), *EIGHT_B_GPUS)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "< max_model_len 600000" in done.stdout


def test_the_command_says_how_it_is_used():
    done = run_plan("--help")
    assert done.returncode == 0 and "--gpu DEPLOYMENT=PRODUCT" in done.stdout and "--json" in done.stdout
