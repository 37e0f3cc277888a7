"""The pools' autoscaling signals and policies (deployments/autoscaling.py), from given figures: no
Ray cluster, no clock but an injected one."""

import types
from pathlib import Path

import pytest
import yaml

from app.scheduler import LoadMeter
from app.telemetry import RoundFacts
from deployments.autoscaling import CallerWaits, DraftPoolPolicy, RoundLoad, TargetPoolPolicy

CONFIG = Path(__file__).resolve().parents[1] / "cluster" / "serve_config.yaml"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def per_replica(**signals) -> dict:
    """Serve's aggregated_metrics shape: signal -> {replica: value}; a signal's list gives one value a replica."""
    return {name: {f"r{i}": v for i, v in enumerate(values)} for name, values in signals.items()}


def test_load_meter_reads_busy_share_fill_and_waits_per_window():
    clock = Clock()
    meter = LoadMeter(clock)
    meter.forward(0.5, items=4, tokens=20)
    meter.forward(1.0, items=2, tokens=10)
    meter.waited(0.2)
    meter.waited(0.4)
    clock.t += 2.0
    assert meter.read() == pytest.approx({"busy": 0.75, "items_per_forward": 3.0, "tokens_per_forward": 15.0,
                                          "queue_wait_s": 0.3, "queue_forwards": 0.4})  # 0.3 s / 0.75 s a forward
    clock.t += 1.0  # a new window: nothing ran
    assert meter.read() == {"busy": 0.0, "items_per_forward": 0.0, "tokens_per_forward": 0.0, "queue_wait_s": 0.0,
                            "queue_forwards": 0.0}


def facts(round_s: float, draft_s: float = 0.0, drafted: int = 0, prompt: bool = False, hit=None) -> RoundFacts:
    return RoundFacts(k=drafted, drafted=drafted, accepted=0, emitted=1, fallback=None, round_s=round_s,
                      draft_s=draft_s, verify_s=round_s - draft_s, draft_forward_s=0.0, verify_forward_s=0.0,
                      batch_size=1, ahead_hit=hit, prompt=prompt)


def test_round_load_counts_waits_for_proposals_but_not_proposals_drafted_ahead():
    load = RoundLoad()
    load.round(facts(0.10, prompt=True))  # a first round: the prefill
    load.round(facts(0.02, draft_s=0.01, drafted=4))  # waited 10 ms of 20 for its proposal
    load.round(facts(0.02, draft_s=0.01, drafted=4, hit=True))  # drafted ahead: no wait
    load.round(facts(0.06))  # plain
    out = load.read()
    assert out == pytest.approx({"wait_share": 0.01 / 0.2, "ttft_s": 0.10})
    assert load.wait_share == pytest.approx(0.025)  # smoothed: what the draft pool hears
    assert load.read() == {"wait_share": 0.0, "ttft_s": 0.0}


def test_caller_waits_average_and_ignore_what_is_not_a_share():
    waits = CallerWaits()
    for share in (0.2, 0.4, None, float("nan"), 7.0):
        waits.add(share)
    assert waits.read() == pytest.approx((0.2 + 0.4 + 1.0) / 3)
    assert waits.read() == 0.0


@pytest.mark.parametrize("busy,wait,queue,current,want", [
    ([0.95, 0.9], [0.0, 0.0], [0.5, 0.5], 2, 4),  # busy: enough replicas to bring the mean to 0.6 (1.85 / 0.6 -> 4)
    ([0.85], [0.0], [0.0], 1, 2),  # busy, one replica: at least one more
    ([0.5, 0.5], [0.3, 0.25], [3.0, 2.0], 2, 3),  # callers wait for proposals that queue: grows
    ([0.5, 0.5], [0.6, 0.6], [0.1, 0.2], 2, 2),  # they wait for the draft's own steps: more replicas would not help
    ([0.5, 0.6], [0.1, 0.1], [0.5, 0.5], 2, 2),  # between the thresholds: holds (hysteresis)
    ([0.1, 0.2], [0.6, 0.5], [0.0, 0.1], 3, 2),  # idle loops, nothing queues: one fewer, whatever callers wait
    ([0.1, 0.2], [0.1, 0.1], [0.5, 0.4], 3, 3),  # idle but proposals still queue: holds
    ([0.05], [0.0], [0.0], 1, 1),  # never below one here (min_replicas is Serve's)
    ([], [], [], 2, 2),  # no figures yet: holds
])
def test_draft_pool_policy(busy, wait, queue, current, want):
    assert DraftPoolPolicy().desired(current, per_replica(busy=busy, wait_share=wait, queue_forwards=queue)) == want


@pytest.mark.parametrize("signals,current,want", [
    ({"kv": [0.9, 0.8]}, 2, 3),  # KV pressure (mean 0.85 is not above: 0.9 and 0.95 are)
    ({"kv": [0.9, 0.95]}, 2, 3),
    ({"queue_forwards": [3.0]}, 1, 2),  # rounds wait three forwards for theirs
    ({"ttft_s": [0.1, 3.0]}, 2, 3),  # one replica's first rounds past the goal
    ({"busy": [0.97]}, 1, 2),  # saturated forward loop
    ({"kv": [0.6], "queue_forwards": [1.0], "ttft_s": [0.5], "busy": [0.7]}, 2, 2),  # in the band: holds
    ({"kv": [0.1, 0.2], "queue_forwards": [0.0, 0.3], "ttft_s": [0.2, 0.3], "busy": [0.2, 0.3]}, 2, 1),  # cold
    ({"kv": [0.1], "queue_forwards": [0.0], "ttft_s": [1.5], "busy": [0.2]}, 2, 2),  # first rounds not cold: holds
    ({"kv": [0.1], "queue_forwards": [0.0], "ttft_s": [0.1], "busy": [0.1]}, 1, 1),
    ({}, 3, 3),
])
def test_target_pool_policy(signals, current, want):
    metrics = per_replica(**{"kv": [], "queue_forwards": [], "ttft_s": [], "busy": [], **signals})
    assert TargetPoolPolicy().desired(current, metrics) == want


def shipped(deployment: str) -> dict:
    app = yaml.safe_load(CONFIG.read_text())["applications"][0]
    return next(d for d in app["deployments"] if d["name"] == deployment)["autoscaling_config"]


@pytest.mark.parametrize("deployment,policy", [("DraftServer", DraftPoolPolicy), ("TargetServer", TargetPoolPolicy)])
def test_the_shipped_config_scales_each_pool_on_its_own_signals(deployment, policy):
    """No target_ongoing_requests: each pool's policy, with the config's thresholds, is what decides;
    Serve's schema takes the file as it is."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    cfg = shipped(deployment)
    assert "target_ongoing_requests" not in cfg
    module, name = cfg["policy"]["policy_function"].split(":")
    assert (module, name) == ("deployments.autoscaling", policy.__name__)
    policy(**cfg["policy"]["policy_kwargs"])  # every threshold is a field of the policy


def serve_decisions(policy, cfg: dict, metrics: dict, current: int, times: list[float], monkeypatch) -> list[int]:
    """Serve's own wrapper around a custom policy (scaling factors, delays) deciding at the given
    times, then its bounds (min/max_replicas, as the controller's apply_bounds), the deployment's
    replicas following each decision."""
    import ray.serve.autoscaling_policy as serve_policy
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    clock = Clock()
    monkeypatch.setattr(serve_policy, "time", types.SimpleNamespace(time=clock))
    config = AutoscalingConfig(**{k: v for k, v in cfg.items() if k != "policy"})
    wrapped = serve_policy._apply_autoscaling_config(policy)
    state, out = {}, []
    for t in times:
        clock.t = 1000.0 + t
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="d", app_name="specserve", current_num_replicas=current,
            target_num_replicas=current, running_replicas=[], total_num_requests=1.0, total_queued_requests=0.0,
            aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
            capacity_adjusted_max_replicas=config.max_replicas, policy_state=state, last_scale_up_time=None,
            last_scale_down_time=None, current_time=clock.t, config=config)
        decision, state = wrapped(ctx)
        current = min(max(int(decision), config.min_replicas), config.max_replicas)
        out.append(current)
    return out


def test_a_draft_bound_load_grows_the_draft_pool_after_the_delay_up_to_its_bound(monkeypatch):
    cfg = shipped("DraftServer")
    policy = DraftPoolPolicy(**cfg["policy"]["policy_kwargs"])
    busy = per_replica(busy=[0.98], wait_share=[0.4], queue_forwards=[4.0])
    # wants more at once; Serve grants it once the want has lasted upscale_delay_s (10 s)
    assert serve_decisions(policy, cfg, busy, 1, [0, 5, 10], monkeypatch) == [1, 1, 2]
    hot = per_replica(busy=[0.98] * 4, wait_share=[0.4] * 4, queue_forwards=[4.0] * 4)
    assert serve_decisions(policy, cfg, hot, 4, [0, 10, 20], monkeypatch) == [4, 4, 4]  # max_replicas


def test_an_idle_draft_pool_shrinks_only_after_the_down_delay(monkeypatch):
    cfg = shipped("DraftServer")
    policy = DraftPoolPolicy(**cfg["policy"]["policy_kwargs"])
    idle = per_replica(busy=[0.05, 0.1, 0.1], wait_share=[0.0, 0.0, 0.0], queue_forwards=[0.0, 0.0, 0.0])
    assert serve_decisions(policy, cfg, idle, 3, [0, 30, 59, 60], monkeypatch) == [3, 3, 3, 2]


def test_the_target_pool_holds_while_the_draft_pool_is_the_bottleneck(monkeypatch):
    """The other pool stays put: a target replica that waits for proposals is neither hot nor cold."""
    cfg = shipped("TargetServer")
    policy = TargetPoolPolicy(**cfg["policy"]["policy_kwargs"])
    waiting = per_replica(kv=[0.3], queue_forwards=[0.6], ttft_s=[0.4], busy=[0.55])
    assert serve_decisions(policy, cfg, waiting, 1, [0, 10, 20, 130], monkeypatch) == [1, 1, 1, 1]
    hot = per_replica(kv=[0.3], queue_forwards=[6.0], ttft_s=[0.5], busy=[0.9])
    assert serve_decisions(policy, cfg, hot, 1, [0, 10, 20], monkeypatch) == [1, 2, 2]  # max_replicas 2


def test_the_ramp_goes_one_to_peak_to_one():
    from cluster.ramp import level

    shape = [level(t, 240, 32) for t in range(0, 241, 10)]
    assert shape[0] == 1 and shape[-1] == 1 and max(shape) == 32 == shape[12]
    assert shape[:13] == sorted(shape[:13]) and shape[12:] == sorted(shape[12:], reverse=True)


def test_kv_pressure_counts_live_sequences_not_retired_donors(target_runner):
    """A pool full of finished sequences kept as prefix donors is no pressure: they go first, free."""
    from app.model.runner import SeqInput

    store = target_runner.cache
    target_runner.forward([SeqInput("a", list(range(3, 40)), 1), SeqInput("b", list(range(5, 60)), 1)])
    both = store.live_bytes
    assert both == store.nbytes > 0
    target_runner.release("a")  # retired: a prefix donor
    assert 0 < store.live_bytes < both == store.nbytes
    target_runner.release("b")
    assert store.live_bytes == 0 < store.nbytes


def test_the_ramps_baseline_is_serves_default_policy_on_ongoing_requests():
    from cluster.local import load_config
    from cluster.ramp import baseline_deployments

    over = baseline_deployments(load_config())
    for name, ongoing in (("DraftServer", 8), ("TargetServer", 16)):
        cfg = over[name]["autoscaling_config"]
        assert "policy" not in cfg and cfg["target_ongoing_requests"] == ongoing
        assert cfg["max_replicas"] == shipped(name)["max_replicas"]
