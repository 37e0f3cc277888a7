"""Load ramp: streams go 1 -> peak -> 1 on a local cluster while each pool's autoscaling follows its
own signals (deployments/autoscaling.py). It records, every few seconds, the replicas of each pool,
the signals each replica gave its policy, client TTFT and TPOT (p50, p99) and the draft's share of
the critical path, then writes a JSON report and a plot (replicas and load against time).

    .venv/bin/python -m cluster.ramp --bottleneck draft  [--minutes 4] [--tail 3] [--peak 32] [--json F] [--plot F]
    .venv/bin/python -m cluster.ramp --bottleneck target ...
    .venv/bin/python -m cluster.ramp --baseline ...      # Serve's default policy, as shipped before

`--tail` minutes at one stream follow the ramp, so that the scale-down delays (60 s for the draft
pool, 120 s for the target pool) pass and the plot shows the pools shrink back.

The shipped config's policies and thresholds, delays and bounds, on fractional replicas (a 2-core
machine holds them all). Which pool is the bottleneck is set by configuration:
- draft: one sequence per draft forward (`draft_batch.max_batch_size: 1`) and 8 tokens drafted a
  round with nothing drafted ahead, so every round waits for the draft pool;
- target: speculation off (the draft pool gets no calls) and two sequences per target forward
  (`target_batch.max_batch_size: 2`), so requests queue for the target.
On a 2-core machine more replicas share the same cores: the benchmark shows which pool the
policies grow and when, not more throughput.
"""

import argparse
import json
import math
import threading
import time
import urllib.request
from collections import defaultdict

import httpx

from cluster.local import LocalCluster, deploy, load_config

POOLS = {"draft": "DraftServer", "target": "TargetServer"}
PROMPT = "def parse(line):\n    "


def bottleneck_config(which: str) -> tuple[dict, dict]:
    """(app args, request body extras) that make `which` pool the bottleneck."""
    if which == "draft":
        return ({"draft_batch": {"max_batch_size": 1},
                 "speculation": {"draft_ahead": False, "goodput_gate": False, "draft_timeout_s": 30.0}},
                {"speculation": {"num_tokens": 8}})
    return ({"target_batch": {"max_batch_size": 2}}, {"speculation": {"enabled": False}})


# the autoscaling this project shipped before its own policies: Serve's default on ongoing requests
BASELINE = {"DraftServer": {"target_ongoing_requests": 8}, "TargetServer": {"target_ongoing_requests": 16}}


def baseline_deployments(config: dict) -> dict:
    """Per-deployment overrides that put `config`'s pools back on Serve's default policy."""
    out = {}
    for d in config["applications"][0]["deployments"]:
        if d["name"] in BASELINE:
            cfg = {k: v for k, v in d["autoscaling_config"].items() if k != "policy"}
            out[d["name"]] = {"autoscaling_config": {**cfg, **BASELINE[d["name"]]}}
    return out


def level(t: float, total: float, peak: int) -> int:
    """Streams wanted at time t of a ramp of `total` seconds: 1 -> peak (first half) -> 1."""
    half = total / 2
    x = t / half if t < half else max(0.0, (total - t) / half)
    return max(1, min(peak, round(1 + (peak - 1) * x)))


class Load:
    """`peak` client threads; thread i streams requests while i < the current level."""

    def __init__(self, url: str, peak: int, extra: dict, max_tokens: int):
        self.url, self.peak, self.extra, self.max_tokens = url, peak, extra, max_tokens
        self.level = 1
        self.stop = threading.Event()
        self.records: list[dict] = []  # per request: end time, ttft, tpot, ok
        self.lock = threading.Lock()

    def run(self, i: int) -> None:
        body = {"model": "target", "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, **self.extra}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                if i >= self.level:
                    time.sleep(0.2)
                    continue
                t0, first, ok = time.monotonic(), None, False
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {") and '"text"' in line:
                                first = first or time.monotonic()
                            ok = ok or line == "data: [DONE]"
                except httpx.HTTPError:
                    ok = False
                end = time.monotonic()
                with self.lock:
                    self.records.append({"end": end, "ok": ok and first is not None,
                                         "ttft_s": (first - t0) if first else None,
                                         "tpot_s": (end - first) / max(1, self.max_tokens - 1) if first else None})


def replicas() -> dict[str, int]:
    from ray import serve

    deps = serve.status().applications["specserve"].deployments
    return {pool: deps[name].replica_states.get("RUNNING", 0) for pool, name in POOLS.items()}


def signals() -> dict[str, dict[str, float]]:
    """Each pool's autoscaling signals, averaged over its replicas (the gauges each replica sets when
    Serve reads its figures), from every node's metrics agent."""
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, list[float]]] = {"draft": defaultdict(list), "target": defaultdict(list)}
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        try:
            text = urllib.request.urlopen(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics",
                                          timeout=5).read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "ray_specserve_autoscaling_signal":
                    pool = "draft" if s.labels.get("deployment") == POOLS["draft"] else "target"
                    out[pool][s.labels["signal"]].append(s.value)
    return {pool: {k: sum(v) / len(v) for k, v in sig.items()} for pool, sig in out.items()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def ramp(which: str, minutes: float, peak: int, max_tokens: int, sample_s: float, baseline: bool = False,
         tail_minutes: float = 0.0, progress=print) -> dict:
    args, extra = bottleneck_config(which)
    with LocalCluster(system_config={"metrics_report_interval_ms": 1000}):
        config = load_config(args=args, port=_free_port())
        if baseline:
            config = load_config(args=args, port=config["http_options"]["port"],
                                 deployments=baseline_deployments(config))
        port = config["http_options"]["port"]
        deploy(config, timeout_s=600)
        url = f"http://127.0.0.1:{port}"
        load = Load(url, peak, extra, max_tokens)
        threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(peak)]
        for t in threads:
            t.start()
        total, start, timeline = minutes * 60, time.monotonic(), []
        try:
            while (now := time.monotonic() - start) < total + tail_minutes * 60:  # the tail: one stream
                load.level = level(now, total, peak)
                with load.lock:
                    recent = [r for r in load.records if r["end"] >= start + now - 10 and r["ok"]]
                point = {"t": round(now, 1), "streams": load.level, "replicas": replicas(), "signals": signals(),
                         "ttft_p50": percentile([r["ttft_s"] for r in recent], 0.5),
                         "ttft_p99": percentile([r["ttft_s"] for r in recent], 0.99),
                         "tpot_p50": percentile([r["tpot_s"] for r in recent], 0.5),
                         "tpot_p99": percentile([r["tpot_s"] for r in recent], 0.99)}
                timeline.append(point)
                progress(f"t={point['t']:6.1f}s streams={point['streams']:2d} replicas={point['replicas']} "
                         f"draft={_short(point['signals']['draft'])} target={_short(point['signals']['target'])}")
                time.sleep(sample_s)
        finally:
            load.stop.set()
            for t in threads:
                t.join(timeout=150)
    done = [r for r in load.records if r["ok"]]
    return {"bottleneck": which, "policies": "serve-default" if baseline else "shipped", "minutes": minutes,
            "tail_minutes": tail_minutes, "peak": peak, "max_tokens": max_tokens,
            "requests": len(load.records), "completed": len(done), "timeline": timeline,
            "max_replicas": {p: max(x["replicas"][p] for x in timeline) for p in POOLS},
            "last_replicas": timeline[-1]["replicas"] if timeline else {},
            # over the whole run, every completed request
            **{f"{key}_{name}": percentile([r[f"{key}_s"] for r in done], q)
               for key in ("ttft", "tpot") for name, q in (("p50", 0.5), ("p99", 0.99))}}


def _short(sig: dict) -> str:
    return "{" + ", ".join(f"{k}={v:.2f}" for k, v in sig.items()) + "}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot(reports: list[dict], path: str) -> None:
    """Per report: replicas of each pool and streams against time; the pool signals; TTFT/TPOT p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(reports), figsize=(6 * len(reports), 9), squeeze=False, sharex="col")
    for col, rep in enumerate(reports):
        tl = rep["timeline"]
        t = [p["t"] for p in tl]
        ax = axes[0][col]
        ax.plot(t, [p["replicas"]["draft"] for p in tl], label="draft replicas", drawstyle="steps-post")
        ax.plot(t, [p["replicas"]["target"] for p in tl], label="target replicas", drawstyle="steps-post")
        ax.set_ylabel("replicas")
        ax.set_title(f"{rep['bottleneck']}-bound ramp, 1 -> {rep['peak']} -> 1 streams, {rep.get('policies', 'shipped')}")
        if rep.get("tail_minutes"):
            for a in axes[:, col]:
                a.axvline(rep["minutes"] * 60, color="grey", linestyle=":", linewidth=1)  # the tail starts
        ax2 = ax.twinx()
        ax2.plot(t, [p["streams"] for p in tl], color="grey", alpha=0.4, label="streams")
        ax2.set_ylabel("streams")
        ax.legend(loc="upper left")
        ax = axes[1][col]
        for pool, names in (("draft", ("busy", "wait_share")), ("target", ("busy", "kv", "queue_forwards"))):
            for name in names:
                ax.plot(t, [p["signals"][pool].get(name, float("nan")) for p in tl], label=f"{pool} {name}")
        ax.set_ylabel("signal")
        ax.legend(loc="upper left", fontsize=7)
        ax = axes[2][col]
        for key in ("ttft_p99", "tpot_p99", "ttft_p50"):
            ax.plot(t, [p[key] if p[key] is not None else float("nan") for p in tl], label=key)
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.set_xlabel("time (s)")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bottleneck", choices=sorted(POOLS), action="append",
                    help="the pool made the bottleneck (repeatable: one ramp each); default both")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--peak", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tail", type=float, default=0.0, help="minutes at one stream after the ramp")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--baseline", action="store_true",
                    help="Serve's default policy on ongoing requests, as shipped before (draft 8, target 16)")
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--plot", help="write the plot here (PNG)")
    a = ap.parse_args()
    reports = [ramp(which, a.minutes, a.peak, a.max_tokens, a.sample_s, a.baseline, a.tail)
               for which in a.bottleneck or ["draft", "target"]]
    for rep in reports:
        print(f"{rep['bottleneck']}-bound: {rep['completed']}/{rep['requests']} requests, "
              f"most replicas {rep['max_replicas']}, at the end {rep['last_replicas']}, "
              f"TTFT p50/p99 {_ms(rep['ttft_p50'])}/{_ms(rep['ttft_p99'])} ms, "
              f"TPOT p50/p99 {_ms(rep['tpot_p50'])}/{_ms(rep['tpot_p99'])} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1)
    if a.plot:
        plot(reports, a.plot)


if __name__ == "__main__":
    main()
