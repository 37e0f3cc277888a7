"""Draft and target pools scale independently: each follows its own autoscaling_config."""

import threading
import time

import httpx
import pytest
from ray import serve

from cluster.local import deploy, load_config
from serving import running_app, save_tiny_pair

pytestmark = pytest.mark.slow

QUICK = {"upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 0.5, "look_back_period_s": 2}


def autoscaling(scale: bool) -> dict:
    """Scales to 2 replicas under a handful of concurrent streams, or never (target far above the load)."""
    return {"autoscaling_config": {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                                   "target_ongoing_requests": 1 if scale else 1000, **QUICK}}


def running(name: str) -> int:
    states = serve.status().applications["specserve"].deployments[name].replica_states
    return states.get("RUNNING", 0)


def load_until(url: str, done, seconds: float = 90) -> None:
    """Keep 12 greedy streams busy until done() or the time is up."""
    stop = time.monotonic() + seconds

    def stream():
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop and not done():
                c.post(f"{url}/v1/completions", json={"model": "target", "prompt": "def f(x):", "max_tokens": 48,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "speculation": {"num_tokens": 4}})
    threads = [threading.Thread(target=stream) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_draft_and_target_scale_independently(tmp_path):
    target, draft = save_tiny_pair(tmp_path)
    args = {"target": {"model": target, "dtype": "float32"}, "draft": {"model": draft},
            "speculation": {"draft_timeout_s": 30.0}}
    with running_app(target, draft, deployments={"DraftServer": autoscaling(True),
                                                 "TargetServer": autoscaling(False)}) as url:
        load_until(url, lambda: running("DraftServer") >= 2)
        assert running("DraftServer") == 2, "the draft pool did not scale up under load"
        assert running("TargetServer") == 1, "the target pool scaled although its config says not to"

        # the reverse: the target scales, the draft keeps its count
        port = int(url.rsplit(":", 1)[1])
        deploy(load_config(args=args, port=port, deployments={"DraftServer": autoscaling(False),
                                                              "TargetServer": autoscaling(True)}))
        draft_count = running("DraftServer")
        load_until(url, lambda: running("TargetServer") >= 2)
        assert running("TargetServer") == 2, "the target pool did not scale up under load"
        assert running("DraftServer") == draft_count
