"""`specserve serve` as an operator runs it: up, then SIGTERM stops the app and its cluster and exits 0."""

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml

from cluster.local import load_config
from serving import free_port, quick_shutdown, save_tiny_pair

pytestmark = pytest.mark.slow


def test_sigterm_stops_the_app_and_its_cluster_and_exits_0(tmp_path):
    target, draft = save_tiny_pair(tmp_path)
    port = free_port()
    # the shipped config, its steps eager and its replicas quick to drain: what is tested is the stop
    config = quick_shutdown(load_config(args={"target": {"compile": "off"}, "draft": {"compile": "off"}}))
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--config", str(tmp_path / "serve.yaml"),
                             "--target", target, "--draft", draft, "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled",
                                 "SPECSERVE_CORE_LOCKS": str(tmp_path / "cores")})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        assert proc.poll() is None, proc.stdout.read()
        children = psutil.Process(proc.pid).children(recursive=True)  # the cluster's processes
        assert children
        assert_pinned_apart(children)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, output[-3000:]
        assert "SIGTERM received" not in output and "stopping the app and the cluster" in output
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:  # only what this test started, by its process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def assert_pinned_apart(processes: list[psutil.Process], timeout_s: float = 120.0) -> None:
    """`serve` pins the target and the draft replica to a core each (deployments/cores.py), apart where
    the machine has two cores to give. A replica pins as its constructor starts: polled until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        cores = replica_cores(processes)
        pinned = len(cores) == 2 and all(len(c) == 1 for c in cores.values())
        if pinned or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(cores) == {"TargetServer", "DraftServer"}, cores
    assert len(cores["TargetServer"]) == 1, cores
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(cores["DraftServer"]) == 1 and cores["DraftServer"] != cores["TargetServer"], cores


def replica_cores(processes: list[psutil.Process]) -> dict[str, list[int]]:
    """The CPU affinity of each pool's replica process, by its process title."""
    cores = {}
    for p in processes:
        try:
            title = " ".join(p.cmdline())
            for name in ("TargetServer", "DraftServer"):
                if name in title:
                    cores[name] = p.cpu_affinity()
        except psutil.NoSuchProcess:
            continue
    return cores
