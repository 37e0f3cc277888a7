"""The local cluster starts its nodes again when Ray times out waiting for one (a loaded machine),
and only then."""

import pytest

from cluster import local


class FlakyCluster:
    """Stands in for ray.cluster_utils.Cluster: its first `failures` draft nodes fail as Ray's do."""

    made, failures, error = [], 1, "The current node timed out during startup. This could happen because ..."

    def __init__(self, **kwargs):
        self.nodes, self.down = ["head"], False
        FlakyCluster.made.append(self)

    def add_node(self, **kwargs):
        if FlakyCluster.failures:
            FlakyCluster.failures -= 1
            raise Exception(FlakyCluster.error)
        self.nodes.append(kwargs["resources"])

    def wait_for_nodes(self):
        pass

    def shutdown(self):
        self.down = True


@pytest.fixture
def flaky(monkeypatch):
    FlakyCluster.made, FlakyCluster.failures = [], 1
    monkeypatch.setattr(local, "LOCAL_ENV", {})
    return FlakyCluster


def start(cluster: local.LocalCluster, cls) -> None:
    cluster._start_with_retries(cls, {"num_cpus": 1}, {"node_ip_address": "127.0.0.1"})


def test_a_node_that_times_out_starting_gets_the_nodes_started_again(flaky):
    cluster = local.LocalCluster(draft_nodes=1)
    start(cluster, flaky)
    first, second = flaky.made
    assert first.down and not second.down  # the half-started cluster was stopped
    assert cluster.cluster is second and second.nodes == ["head", {local.DRAFT_POOL: cluster.slots}]


def test_other_start_errors_and_the_last_timeout_are_raised(flaky):
    flaky.error = "port in use"
    with pytest.raises(Exception, match="port in use"):
        start(local.LocalCluster(), flaky)
    flaky.error, flaky.failures = f"node {local.STARTUP_TIMEOUT}", local.STARTUP_ATTEMPTS
    with pytest.raises(Exception, match=local.STARTUP_TIMEOUT):
        start(local.LocalCluster(), flaky)
    assert len(flaky.made) == 1 + local.STARTUP_ATTEMPTS


def test_serve_on_a_small_machine_caps_each_pool_at_half_its_cores():
    from cluster.local import fit_to_cores, load_config

    config = load_config()
    pools = {d["name"]: d["autoscaling_config"] for d in config["applications"][0]["deployments"]
             if d["name"] in ("TargetServer", "DraftServer")}
    assert pools["TargetServer"]["max_replicas"] == 2 and pools["DraftServer"]["max_replicas"] == 4
    changed = fit_to_cores(config, cores=2)
    assert pools["TargetServer"]["max_replicas"] == pools["DraftServer"]["max_replicas"] == 1
    assert all(s["min_replicas"] <= s["max_replicas"] and s["initial_replicas"] <= 1 for s in pools.values())
    assert len(changed) == 2 and "2 cores" in changed[0]
    roomy = load_config()
    assert fit_to_cores(roomy, cores=16) == []
    assert roomy == load_config()


def test_serve_pins_the_pairs_replicas_unless_the_config_says():
    from cluster.local import load_config, pin_to_cores

    config = load_config()
    assert "cores of their own" in pin_to_cores(config)[0]
    args = config["applications"][0]["args"]
    assert args["target"]["pin_cores"] is True and args["draft"]["pin_cores"] is True
    assert args["target"]["dtype"] == load_config()["applications"][0]["args"]["target"]["dtype"]  # merged, not replaced
    told = load_config(args={"target": {"pin_cores": False}, "draft": None})
    assert pin_to_cores(told) == []
    assert told["applications"][0]["args"]["target"]["pin_cores"] is False
    assert told["applications"][0]["args"]["draft"] is None
    shipped = load_config()["applications"][0]["args"]  # and the KubeRay manifests made from it: off
    assert "pin_cores" not in shipped["target"] and "pin_cores" not in shipped["draft"]


def test_deploy_says_which_deployments_are_still_starting(monkeypatch):
    """A first start loads the models and builds kernels for minutes: deploy reports what it still waits for."""
    from types import SimpleNamespace

    from ray import serve
    from ray.serve._private import api as serve_api

    def app(running: set[str]):
        deployments = {d: SimpleNamespace(replica_states={"RUNNING": 1} if d in running else {"STARTING": 1})
                       for d in ("TargetServer", "DraftServer")}
        return SimpleNamespace(applications={"specserve": SimpleNamespace(
            status="RUNNING" if len(running) == 2 else "DEPLOYING", deployments=deployments, message="")})

    states = iter([app(set()), app({"DraftServer"}), app({"DraftServer", "TargetServer"})])
    monkeypatch.setattr(serve, "status", lambda: next(states))
    monkeypatch.setattr(serve_api, "serve_start", lambda **kw: SimpleNamespace(deploy_apps=lambda *a, **k: None))
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    config = {"applications": [{"name": "specserve", "import_path": "x:y", "route_prefix": "/",
                                "deployments": [{"name": "TargetServer"}, {"name": "DraftServer"}]}]}
    lines = []
    local.deploy(config, timeout_s=60, progress=lines.append, every_s=0)
    assert len(lines) == 2 and "DraftServer, TargetServer" in lines[0] and "DraftServer" not in lines[1]
    assert "TargetServer" in lines[1]


def test_serve_says_how_far_the_background_compile_has_got_then_once_that_it_is_done(monkeypatch):
    import threading

    stop = threading.Event()
    answers = iter([{"TargetServer": "compiling 2/8", "DraftServer": "compiling 5/8"},
                    {"TargetServer": "compiling 7/8", "DraftServer": "compiled"},
                    {}, {"TargetServer": "compiled", "DraftServer": "compiled"}])

    def status(name):
        out = next(answers)
        if out.get("TargetServer") == "compiled":
            stop.set()  # what Ctrl-C does: the watch must then return
        return out

    monkeypatch.setattr(local, "steps_status", status)
    lines = []
    local.watch_steps("specserve", stop, lines.append, every_s=0)
    assert len(lines) == 3, lines
    assert "DraftServer 5/8, TargetServer 2/8" in lines[0] and "TargetServer 7/8" in lines[1]
    assert "DraftServer" not in lines[1] and "DraftServer compiled, TargetServer compiled" in lines[2]


def test_serve_says_when_a_build_is_retried_and_when_it_failed(monkeypatch):
    import threading

    stop = threading.Event()
    answers = iter([{"TargetServer": "compiling 3/8, retry", "DraftServer": "compiled"},
                    {"TargetServer": "eager: the build failed twice (RuntimeError: no room)", "DraftServer": "compiled"}])
    monkeypatch.setattr(local, "steps_status", lambda name: next(answers))
    lines = []
    watch = threading.Thread(target=local.watch_steps, args=("specserve", stop, lines.append), kwargs={"every_s": 0})
    watch.start()
    while len(lines) < 2 and watch.is_alive():
        watch.join(0.01)
    stop.set()
    watch.join(60)
    assert "TargetServer 3/8, retry" in lines[0]
    assert "TargetServer eager: the build failed twice (RuntimeError: no room)" in lines[1]
