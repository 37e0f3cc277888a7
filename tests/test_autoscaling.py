"""Draft and target pools scale independently, each on its own signals (deployments/autoscaling.py),
with the shipped policies: no target_ongoing_requests anywhere."""

import threading
import time

import httpx
import pytest
import yaml
from ray import serve

from cluster.local import CONFIG, deploy, load_config
from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow

QUICK = {"upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 0.5, "look_back_period_s": 2}


def autoscaling(name: str, **policy_kwargs) -> dict:
    """The shipped autoscaling_config of deployment `name` (its policy and thresholds), with quick
    delays, at most 2 replicas, and any threshold given here changed."""
    app = yaml.safe_load(CONFIG.read_text())["applications"][0]
    cfg = next(d for d in app["deployments"] if d["name"] == name)["autoscaling_config"]
    assert "target_ongoing_requests" not in cfg
    policy = {**cfg["policy"], "policy_kwargs": {**cfg["policy"]["policy_kwargs"], **policy_kwargs}}
    return {"autoscaling_config": {**cfg, **QUICK, "max_replicas": 2, "policy": policy}}


def running(name: str) -> int:
    states = serve.status().applications["specserve"].deployments[name].replica_states
    return states.get("RUNNING", 0)


def load_until(url: str, done, body: dict, seconds: float = 90) -> None:
    """Keep 12 greedy streams busy until done() (polled every 0.2 s) or the time is up; then close
    every stream at once (a closed stream cancels its request), so that no load outlives the phase."""
    stop = threading.Event()

    def stream():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                with c.stream("POST", f"{url}/v1/completions", json={
                        "model": "target", "prompt": "def f(x):", "max_tokens": 48, "temperature": 0,
                        "ignore_eos": True, "stream": True, **body}) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break
    threads = [threading.Thread(target=stream) for _ in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done():
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()


def test_draft_and_target_scale_independently(tmp_path):
    """A draft-bound load (one sequence per draft forward, 8 tokens drafted a round, nothing drafted
    ahead: proposals queue at the draft) grows the draft pool and not the target pool. Then a load the target cannot
    serve within its first-round goal (set to 1 ms here), with speculation off, grows the target
    pool and leaves the draft pool as it is."""
    target, draft = save_tiny_pair(tmp_path)
    # eager forwards: each replica the pools add starts without compiling its steps
    args = {"target": {"model": target, "dtype": "float32", "compile": "off"}, "draft": {"model": draft, "compile": "off"},
            "speculation": {"draft_timeout_s": 30.0, "draft_ahead": False, "goodput_gate": False},
            "draft_batch": {"max_batch_size": 1}}
    with running_app(target, draft, args=args, deployments={"DraftServer": autoscaling("DraftServer"),
                                                            "TargetServer": autoscaling("TargetServer")}) as url:
        # the target pool is read as the draft pool grows: from then on the load is no longer draft-bound,
        # and the target pool may rightly grow (a target replica at busy 0.4 serves twice that with two drafts)
        seen = {}

        def draft_grew() -> bool:
            targets = running("TargetServer")
            if running("DraftServer") < 2:
                return False
            seen["targets"] = targets
            return True

        load_until(url, draft_grew, {"speculation": {"num_tokens": 8}})
        assert seen, "the draft pool did not scale up under a draft-bound load"
        assert seen["targets"] == 1, "the target pool scaled under a draft-bound load"

        port = int(url.rsplit(":", 1)[1])
        deploy(load_config(args=args, port=port, deployments={
            "DraftServer": autoscaling("DraftServer"), "TargetServer": autoscaling("TargetServer", ttft_goal_s=0.001)}))
        draft_count = running("DraftServer")
        load_until(url, lambda: running("TargetServer") >= 2, {"speculation": {"enabled": False}})
        assert running("TargetServer") == 2, "the target pool did not scale up past its first-round goal"
        assert running("DraftServer") == draft_count
