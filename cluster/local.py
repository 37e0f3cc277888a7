"""A local multi-node Ray cluster: nodes offering draft_pool or target_pool, like KubeRay's worker groups.

Ray's own `ray.cluster_utils.Cluster` starts the nodes (several raylets on one machine); this
module adds the pools and deploys a Serve config onto them the way `serve run` does.
"""

import contextlib
import copy
import os
import signal
import threading
import time
from pathlib import Path

import yaml

CONFIG = Path(__file__).with_name("serve_config.yaml")


def pair_config(pair: str) -> Path:
    """The shipped Serve config for a built pair: its own (serve_config.<pair>.yaml) where it has one."""
    own = CONFIG.with_name(f"serve_config.{pair}.yaml")
    return own if own.exists() else CONFIG
DRAFT_POOL, TARGET_POOL = "draft_pool", "target_pool"
# Ray waits a fixed 30 s for a new node's raylet to register with the GCS; on a loaded machine one
# slow GCS call can use all of it (seen once in three suite runs beside a CPU burner). Starting the
# nodes again then succeeds: a startup timeout is retried, other errors are not.
STARTUP_ATTEMPTS = 3
STARTUP_TIMEOUT = "timed out during startup"
# Ray Serve's own throughput profile, on every process of the cluster (the k8s manifests set the same): the
# ingress replica answers HTTP itself (direct ingress), deployments call each other over gRPC, and
# replica code runs on the replica's main event loop, not a second thread. Measured with
# `specserve bench --url` at 16 streams: 190 -> 250 tok/s target-only, 163 -> 280 speculative;
# the second user-code thread was fighting the forward thread for the GIL on every chunk.
# The proxy callback installs HTTP failover in Serve's proxy: a request whose ingress replica dies
# is sent again and a stream continues where it was cut (deployments/failover.py).
# Ray starts its worker processes (every replica) at niceness 15, so that its raylet and GCS win any
# contention for a core; then any process at the default priority on the node (Ray's own agents, a
# sidecar, a client on the same machine) takes a replica's core whenever it wakes, and a forward or a
# proposal waits for it. A server's replicas are the node's work: they run at the default priority.
# On the reference pair (2 cores, float32, vLLM's client on the same machine, one server reniced between
# passes): C1 speculative 38.2 -> 39.9 tok/s, off 31.6 -> 33.0; C4 102.6 -> 110.2 and 107.0 -> 115.6.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
             "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.failover.proxy_middlewares",
             "RAY_worker_niceness": "0"}
# The local cluster only: a stopping direct-ingress replica keeps serving for a floor of 30 s by
# default, so that an external load balancer (a cloud ALB) can take it out of rotation first. Here the
# only one in front is Serve's own proxy, told at once: 2 s. Every shutdown of a local cluster and
# every ingress scale-down waited the 30 s before (about 5 minutes of the test suite); the k8s
# manifests keep the default.
LOCAL_ENV = {**SERVE_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


class LocalCluster:
    """Head node = target pool; `draft_nodes` more nodes = draft pool. Use as a context manager."""

    def __init__(self, draft_nodes: int = 1, cpus_per_node: int = 4, pool_slots: int = 8,
                 system_config: dict | None = None):
        self.draft_nodes, self.cpus, self.slots = draft_nodes, cpus_per_node, pool_slots
        # Ray's _system_config, e.g. {"metrics_report_interval_ms": 1000} for a quicker metrics export;
        # every node's metrics agent serves Prometheus text on the node's MetricsExportPort (see ray.nodes())
        self.system_config = system_config or {}
        self.cluster = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> "LocalCluster":
        # token auth would need the same token on every node; locally all nodes are this machine
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray rewrites 127.0.0.1 to the machine's outward address unless it believes it is a
        # single-machine cluster: keep every address (GCS, raylets, workers) on loopback
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        ray_constants.ENABLE_RAY_CLUSTER = False  # the same, for this already-imported process

        # every node on loopback: nothing of the cluster is reachable from outside this machine
        common = {"num_cpus": self.cpus, "include_dashboard": False, "node_ip_address": "127.0.0.1"}
        head = {**common, "resources": {TARGET_POOL: self.slots}}
        if self.system_config:
            head["_system_config"] = self.system_config  # the head's system config applies cluster-wide
        self._start_with_retries(Cluster, head, common)
        ray.init(address=self.cluster.address, namespace="specserve", log_to_driver=False)
        return self

    def _start_with_retries(self, cluster_cls, head: dict, common: dict) -> None:
        for attempt in range(STARTUP_ATTEMPTS):
            try:
                return self._start_nodes(cluster_cls, head, common)
            except Exception as e:
                if STARTUP_TIMEOUT not in str(e) or attempt == STARTUP_ATTEMPTS - 1:
                    raise
                print(f"local cluster: a node timed out starting ({e}); starting the nodes again", flush=True)
                self._stop_nodes()

    def _start_nodes(self, cluster_cls, head: dict, common: dict) -> None:
        with _environment(LOCAL_ENV):  # the nodes' processes inherit it; this one (a driver) does not
            self.cluster = cluster_cls(initialize_head=True, connect=False, head_node_args=head)
            for _ in range(self.draft_nodes):
                self.cluster.add_node(num_cpus=self.cpus, resources={DRAFT_POOL: self.slots},
                                      node_ip_address=common["node_ip_address"])
        self.cluster.wait_for_nodes()

    def _stop_nodes(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None

    @property
    def address(self) -> str:
        return self.cluster.address

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if self.cluster is None:
            return
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self._stop_nodes()


@contextlib.contextmanager
def _environment(values: dict):
    """Environment variables set (where not set already) for the duration of the block.

    The throughput profile is for the cluster's processes: a driver with it could no longer use a
    Serve handle outside an event loop (its handles would route on the caller's loop)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def load_config(path: str | Path | None = CONFIG, args: dict | None = None, deployments: dict | None = None,
                port: int | None = None, host: str | None = None) -> dict:
    """The Serve config with overrides: `args` merged into the app's args, per-deployment option dicts."""
    config = yaml.safe_load(Path(path or CONFIG).read_text())
    app = config["applications"][0]
    app["args"] = _merge(app.get("args") or {}, args or {})
    for d in app.get("deployments", []):
        d.update((deployments or {}).get(d["name"], {}))
    if port is not None:
        config["http_options"]["port"] = port
    if host is not None:
        config["http_options"]["host"] = host
    return config


POOLS = ("TargetServer", "DraftServer")


def fit_to_cores(config: dict, cores: int | None = None) -> list[str]:
    """Cap each pool's replicas at what this one machine's cores run side by side: half of them each
    (at least 1). The local cluster's nodes are all this machine: on 2 cores a second target replica
    takes the draft's core and both replicas' steps slow down (seen in a benchmark window: the
    autoscaler added one at 16 streams). Returns what it changed, as lines to print."""
    cores = cores or os.cpu_count() or 1
    cap, changed = max(1, cores // 2), []
    for d in config["applications"][0].get("deployments", []):
        scaling = d.get("autoscaling_config")
        if d["name"] in POOLS and scaling and scaling.get("max_replicas", 1) > cap:
            scaling["max_replicas"] = cap
            for key in ("min_replicas", "initial_replicas"):
                if key in scaling:
                    scaling[key] = min(scaling[key], cap)
            replicas = f"{cap} replica{'s' if cap > 1 else ''}"
            changed.append(f"{d['name']}: at most {replicas} on this machine's {cores} cores")
    return changed


def pin_to_cores(config: dict) -> list[str]:
    """Each replica of the pair on cores of its own (`pin_cores`, deployments/cores.py) where the config
    does not say: every node of the local cluster is this machine, and its replicas share its cores.
    Returns what it changed, as lines to print."""
    args = config["applications"][0].setdefault("args", {})
    pinned = [name for name in ("target", "draft") if args.get(name, {}) is not None
              and "pin_cores" not in args.get(name, {})]
    for name in pinned:
        args[name] = {**args.get(name, {}), "pin_cores": True}
    if not pinned:
        return []
    return [f"{' and '.join(pinned)}: each replica's threads on cores of their own (pin_cores; false in a --config "
            f"turns it off)"]


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deploy(config: dict, timeout_s: float = 600, progress=None, every_s: float = 30.0) -> None:
    """Deploy a Serve config dict on the connected cluster and wait until it runs (as `serve run` does).
    `progress(line)`, if given, hears every `every_s` seconds which deployments are still starting."""
    from ray import serve
    from ray.serve._private import api as serve_api  # what `serve run CONFIG` calls; no public equivalent
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    client = serve_api.serve_start(http_options=config.get("http_options", {}))
    client.deploy_apps(schema, _blocking=False)
    name = config["applications"][0]["name"]
    started = time.monotonic()
    deadline, said = started + timeout_s, started
    wanted = {d["name"] for d in config["applications"][0].get("deployments", [])}
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        # RUNNING, and every deployment of the config has a running replica: the status alone read
        # RUNNING once before the replicas existed (a benchmark's first request then waited 43 s)
        if app is not None and app.status == "RUNNING" and all(
                d in app.deployments and app.deployments[d].replica_states.get("RUNNING", 0) > 0 for d in wanted):
            return
        if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {name} failed: {app.message}")
        if progress and time.monotonic() - said >= every_s and app is not None:
            said = time.monotonic()
            waiting = sorted(d for d in wanted if d not in app.deployments
                             or not app.deployments[d].replica_states.get("RUNNING", 0))
            progress(f"  {said - started:4.0f} s: starting {', '.join(waiting) or name} (loading the models; a "
                     "first start on a machine also builds its kernels, and compiles steps before traffic "
                     "where compile_in_background is off)")
        time.sleep(0.5)
    raise TimeoutError(f"application {name} not running after {timeout_s}s")


def steps_status(name: str, deployments=("TargetServer", "DraftServer")) -> dict[str, str]:
    """What each model server of application `name` runs its forwards on (ModelRunner.compile_status:
    "compiling i/n" (", retry" on the second try), "compiled", "eager", or "eager: why" where a build failed
    twice or its steps failed their check), asked of one replica of each; a server not answering is left out."""
    from ray import serve

    out = {}
    for d in deployments:
        try:
            out[d] = serve.get_deployment_handle(d, name).stats.remote().result(timeout_s=10)["steps"]
        except Exception:  # absent (no draft), restarting, or busy past the timeout: asked again later
            pass
    return out


def watch_steps(name: str, stop: threading.Event, progress, every_s: float = 30.0,
                started: float | None = None) -> None:
    """Until `stop` is set: every `every_s` seconds, while a server still compiles its steps in the
    background (it serves eagerly meanwhile), say how far each has got; say once when none does.
    Times are seconds since `started` (a time.monotonic(); default: now)."""
    started = time.monotonic() if started is None else started
    while not stop.wait(every_s):
        status = steps_status(name)
        building = {d: s for d, s in status.items() if s.startswith("compiling")}
        if not building and status:
            progress(f"  {time.monotonic() - started:4.0f} s: steps "
                     + ", ".join(f"{d} {s}" for d, s in sorted(status.items())))
            stop.wait()
            return
        if building:
            progress(f"  {time.monotonic() - started:4.0f} s: serving on eager forwards while compiling "
                     "steps: " + ", ".join(f"{d} {s.removeprefix('compiling ')}" for d, s in sorted(building.items())))


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGINT or SIGTERM (`stop`, or a new one). Call it again once connected to the
    cluster: ray.init installs Ray's native SIGTERM handler, which dumps a stack and kills the process,
    leaving the cluster's processes behind."""
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def main() -> None:
    """`python -m cluster.local`: start the two-pool cluster and keep it up until Ctrl-C."""
    stop = stop_on_signals()  # a signal while the cluster starts: it stops as soon as it is up
    with LocalCluster() as cluster:
        stop_on_signals(stop)
        print(f"local cluster up (head = {TARGET_POOL}, worker = {DRAFT_POOL}); in another shell:\n"
              f"  RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/serve run --address {cluster.address} {CONFIG}\n"
              "Ctrl-C stops the cluster.", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
