"""Faults, overload, cancellation, deadlines and KV memory on a live local cluster, each with figures.

One cluster for the module; two deployments of the app on it, one after the other:
- "faults": two TargetServer replicas, one DraftServer, one Ingress (kill one of each mid-load);
- "limits": one replica each, a tiny TargetServer queue and small KV budgets (overload, disconnect,
  soak, a lone target's restart).
Every request has a timeout and every loop a bound; all traffic stays on loopback.
"""

import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from app.engine import Engine
from cluster.soak import sse_events, take_event
from app.params import SamplingParams
from serving import quick_shutdown, remove_app, save_tiny_pair, shared_cluster

PROMPTS = [f"def g{i}(y):\n    return y" + " * 2" * (i % 4) for i in range(8)]
N = 48  # tokens per load-run request
SOAK_N = 200  # tokens per soak request: prompt + 200 > what the KV budget holds for two sequences
KV_BUDGET = 150_000  # bytes; a 210-token sequence of the tiny pair holds ~107 KB of KV
# two streams at a time in the soak leave room for the stats calls that sample the caches
TARGET_CAPACITY = {"max_ongoing_requests": 4, "max_queued_requests": 4}


# -- set-up --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def reference(pair):
    """Target-only greedy text per (prompt, max_tokens), computed in-process."""
    engine = Engine.from_pretrained(pair[0])
    out = {}
    for n in (N, SOAK_N):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, speculation={"enabled": False})
        out.update({(p, n): r.text for p, r in zip(PROMPTS, engine.generate(PROMPTS, params))})
    return out


def app_config(pair, port: int, name: str) -> dict:
    from cluster.local import load_config

    # eager forwards: each replica (and each replacement a kill brings) would compile its steps beside the
    # load; the served compiled path and its switch from eager are test_serve's
    args = {"target": {"model": pair[0], "dtype": "float32", "compile": "off"},
            "draft": {"model": pair[1], "compile": "off"},
            "speculation": {"draft_timeout_s": 5.0, "draft_retry_after_s": 1.0}}
    replicas = {"faults": {"DraftServer": 1, "TargetServer": 2},
                "two drafts": {"DraftServer": 2, "TargetServer": 2},
                "limits": {"DraftServer": 1, "TargetServer": 1}}[name]
    deployments = {"TargetServer": TARGET_CAPACITY} if name == "limits" else {}
    if name == "limits":
        args["target"]["max_cache_bytes"] = args["draft"]["max_cache_bytes"] = KV_BUDGET
    config = load_config(args=args, deployments=deployments, port=port)
    for d in config["applications"][0]["deployments"]:
        d.pop("autoscaling_config", None)
        d["num_replicas"] = replicas.get(d["name"], 1)
    return quick_shutdown(config)


@pytest.fixture(scope="module")
def deployed(pair):
    """deployed(name) -> base URL, with that deployment of the app running on the session's cluster."""
    from cluster.local import deploy

    port, current = shared_cluster(), {}

    def use(name: str) -> str:
        if current.get("name") != name:
            deploy(app_config(pair, port, name), timeout_s=300)
            current["name"] = name
        return f"http://127.0.0.1:{port}"

    try:
        yield use
    finally:
        if current:
            remove_app("specserve")


def replicas(deployment: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and f"#{deployment}#" in a["name"])


def kill_replica(deployment: str) -> str:
    """Kill one replica's process; Serve starts a replacement."""
    import ray

    name = replicas(deployment)[0]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def running(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications["specserve"].deployments[deployment]
    return status.replica_states.get("RUNNING", 0) if status.status == "HEALTHY" else 0


def wait_until(check, timeout_s: float, every_s: float = 0.25):
    """Poll `check` until it returns something truthy (returned) or the time is up (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    return None


def server_stats(deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, "specserve").stats.remote().result(timeout_s=30)


# -- the client ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One streamed request as the client saw it."""

    prompt: str
    status: int = 0
    text: str = ""
    finished: bool = False  # a finish_reason arrived
    error: dict | None = None  # an error body or SSE error event: a clear failure
    cut: str | None = None  # the stream broke off with neither a finish nor an error: a silent cut
    speculation: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    seconds: float = 0.0


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = N, spec: dict | None = None,
                 started: asyncio.Event | None = None, stop_after: int | None = None,
                 sampling: dict | None = None) -> Outcome:
    """POST a streamed completion (greedy, or `sampling`) and read it to the end (or `stop_after` text chunks)."""
    body = {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "speculation": spec or {"num_tokens": 3},
            **(sampling or {})}
    out, t0, chunks = Outcome(prompt), time.monotonic(), 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            out.status, out.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                out.error = json.loads(await r.aread()).get("error")
                return out
            async for event in sse_events(r):
                take_event(out, event)
                if "error" in event:
                    continue
                out.speculation = event.get("speculation") or out.speculation
                chunks += 1
                if started is not None:
                    started.set()
                if stop_after is not None and chunks >= stop_after:
                    return out  # leaving the block closes the connection mid-stream
        if not (out.finished or out.error):
            out.cut = "stream ended without a finish or an error"
    except httpx.HTTPError as e:
        out.cut = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
    return out


async def load_run(url: str, prompts: list[str], during=None, max_tokens: int = N, spec: dict | None = None,
                   timeout_s: float = 120, sampling: dict | None = None) -> list[Outcome]:
    """All prompts at once, streamed; `during()` runs in a thread once the first tokens arrived."""
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
        tasks = [asyncio.create_task(stream(client, url, p, max_tokens, spec, started, sampling=sampling))
                 for p in prompts]
        if during is not None:
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.to_thread(during)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)


def tally(outcomes: list[Outcome], reference: dict, max_tokens: int = N) -> dict:
    """sent / completed / failed with a clear error / silently cut / differing from the reference."""
    def differs(o: Outcome) -> bool:
        ref = reference[(o.prompt, max_tokens)]
        return not ref.startswith(o.text) or (o.finished and not o.error and o.text != ref)
    return {"sent": len(outcomes), "completed": sum(o.finished and not o.error for o in outcomes),
            "failed_clear": sum(o.error is not None for o in outcomes),
            "silent_cuts": sum(o.cut is not None and o.error is None for o in outcomes),
            # a completed request must be the target's greedy text, and a failed one a prefix of it:
            # nothing streamed is lost or repeated
            "differing": sum(map(differs, outcomes))}


def report(name: str, figures: dict, recovery_s: float | None, outcomes: list[Outcome] = ()) -> None:
    rec = f"{recovery_s:.1f}s" if recovery_s is not None else "not recovered"
    errors = collections.Counter(f"{o.status}/{o.error['code']}: {o.error['message'][:60]}" for o in outcomes if o.error)
    print(f"\n[{name}] " + " ".join(f"{k}={v}" for k, v in figures.items()) + f" recovery={rec} errors={dict(errors)}")


def one(url: str, prompt: str, max_tokens: int = N, spec: dict | None = None) -> Outcome:
    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream(client, url, prompt, max_tokens, spec)
    return asyncio.run(go())


def fault_run(url: str, reference: dict, prompts: list[str], deployment: str, recovered, name: str,
              timeout_s: float = 90, max_tokens: int = N) -> tuple[list[Outcome], dict, bool]:
    """Load `url`, kill one `deployment` replica once tokens flow, then poll `recovered(killed_name)`;
    reports and returns (outcomes, tally, whether it recovered within timeout_s)."""
    killed = {}
    outcomes = asyncio.run(load_run(url, prompts, max_tokens=max_tokens, during=lambda: killed.update(
        t=time.monotonic(), name=kill_replica(deployment))))
    ok = wait_until(lambda: recovered(killed["name"]), timeout_s, every_s=0.5)
    figures = tally(outcomes, reference, max_tokens)
    report(name, figures, time.monotonic() - killed["t"] if ok else None, outcomes)
    return outcomes, figures, bool(ok)


# -- faults --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_draft_killed_mid_load_fails_open_then_speculates_again(deployed, reference):
    url = deployed("faults")

    def speculating(_killed: str) -> bool:  # the replacement is up and the back-off is over
        o = one(url, PROMPTS[0], max_tokens=8)
        return o.finished and o.speculation.get("drafted_tokens", 0) > 0
    _, figures, recovered = fault_run(url, reference, PROMPTS, "DraftServer", speculating, "draft killed")
    assert figures["completed"] == figures["sent"] and figures["differing"] == 0
    assert recovered, "speculation did not resume within 90 s of the draft replica's death"


SEEDED = {"temperature": 0.9, "seed": 11}


@pytest.mark.slow
def test_draft_pool_scaled_up_then_down_mid_load_changes_no_output(deployed, reference):
    """The draft pool goes 1 -> 2 -> 1 replicas (Serve starts one, then stops one gracefully) while waves
    of greedy and seeded streams run: the target replicas move sequences to the new draft replica and
    off the removed one (deployments/affinity.py, Homes), and every output is what it is without scaling."""
    url = deployed("faults")
    wait_until(lambda: running("TargetServer") == 2 and running("DraftServer") == 1, 120)
    seeded_ref = {o.prompt: o.text for o in asyncio.run(load_run(url, PROMPTS, sampling=SEEDED))}
    homes_seen: set[str] = set()
    done, steps = threading.Event(), {}

    def scale():
        try:
            deployed("two drafts")
            steps["up"] = wait_until(lambda: running("DraftServer") == 2, 120)
            # the target replicas' draft homes while two draft replicas serve (polled; the waves run on)
            steps["both drafting"] = wait_until(
                lambda: homes_seen.update(server_stats("TargetServer").get("draft_homes", {})) or len(homes_seen) > 1, 60)
            deployed("faults")
            steps["down"] = wait_until(lambda: len(replicas("DraftServer")) == 1 and running("DraftServer") == 1, 120)
        finally:
            done.set()

    async def wave():
        return await asyncio.gather(load_run(url, PROMPTS), load_run(url, PROMPTS, sampling=SEEDED))

    scaler = threading.Thread(target=scale)
    scaler.start()
    greedy, seeded, waves = [], [], 0
    while not done.is_set() and waves < 60:  # ~3-4 s a wave; scaling takes well under a minute
        g, s = asyncio.run(wave())
        greedy += g
        seeded += s
        waves += 1
    scaler.join(timeout=300)
    figures = tally(greedy, reference)
    differing_seeded = sum(not (o.finished and not o.error and o.text == seeded_ref[o.prompt]) for o in seeded)
    print("\n[draft pool 1 -> 2 -> 1] " + " ".join(f"{k}={v}" for k, v in figures.items())
          + f" seeded={len(seeded)} seeded_differing={differing_seeded} waves={waves} steps={steps}"
          f" draft_homes_seen={len(homes_seen)} moves(one target)={server_stats('TargetServer').get('draft_moves')}")
    assert steps.get("up") and steps.get("both drafting") and steps.get("down"), steps
    assert figures["completed"] == figures["sent"] and figures["differing"] == 0
    assert differing_seeded == 0


@pytest.mark.slow
def test_target_killed_with_two_replicas_loses_nothing(deployed, reference):
    url = deployed("faults")
    wait_until(lambda: running("TargetServer") == 2, 120)
    _, figures, restored = fault_run(
        url, reference, PROMPTS * 2, "TargetServer",
        lambda killed: running("TargetServer") == 2 and killed not in replicas("TargetServer"),
        "target killed (2 replicas)", timeout_s=120)
    assert figures["completed"] == figures["sent"] and figures["differing"] == 0
    assert restored, "no replacement target replica within 120 s"


@pytest.mark.slow
def test_lone_ingress_killed_mid_stream_every_stream_continues_identically(deployed, reference):
    """The ingress holds its requests' router state: killed mid-stream, each stream continues on its
    replacement from what it had streamed (the proxy's failover, deployments/failover.py)."""
    url = deployed("faults")
    _, figures, restored = fault_run(
        url, reference, PROMPTS, "Ingress",
        lambda killed: running("Ingress") == 1 and killed not in replicas("Ingress"), "ingress killed (1 replica)")
    assert figures["completed"] == figures["sent"] and figures["differing"] == 0, figures
    assert restored, "no replacement ingress replica within 90 s"


# -- limits --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_client_disconnect_frees_caches_on_draft_and_target(deployed):
    url = deployed("limits")
    idle = wait_until(lambda: server_stats("TargetServer")["sequences"] == 0 and
                      server_stats("DraftServer")["sequences"] == 0, 30)
    assert idle, f"caches of earlier requests still held: {server_stats('TargetServer')} {server_stats('DraftServer')}"
    prompt = "def long(x):\n"

    async def leave_early():
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream(client, url, prompt, max_tokens=480, stop_after=3)
    out = asyncio.run(leave_early())
    t0 = time.monotonic()
    freed = wait_until(lambda: server_stats("TargetServer")["sequences"] == 0 and
                       server_stats("DraftServer")["sequences"] == 0, 15, every_s=0.05)
    freed_s = time.monotonic() - t0
    full = one(url, prompt, max_tokens=480, spec={"num_tokens": 3})
    print(f"\n[disconnect] read {len(out.text)} chars then closed; caches freed after {freed_s:.2f}s "
          f"(the whole 480-token generation takes {full.seconds:.2f}s)")
    assert out.status == 200 and not out.finished
    assert freed, "KV caches of a disconnected request still held after 15 s"


@pytest.mark.slow
def test_lone_target_killed_requests_resume_or_fail_clearly(deployed, reference):
    url = deployed("limits")
    outcomes, figures, recovered = fault_run(url, reference, PROMPTS[:2], "TargetServer",
                                             lambda _: one(url, PROMPTS[0]).finished, "target killed (1 replica)")
    print("  caches after:", {name: server_stats(name)["sequences"] for name in ("DraftServer", "TargetServer")})
    assert figures["silent_cuts"] == 0 and figures["differing"] == 0
    assert figures["completed"] + figures["failed_clear"] == figures["sent"]
    assert all(o.error["code"] in (503, "503") for o in outcomes if o.error and o.status == 200)
    assert recovered, "no request succeeded within 90 s of the lone target's death"


@pytest.mark.slow
def test_overload_is_refused_at_once_with_retry_after(deployed, reference):
    url = deployed("limits")
    capacity = sum(TARGET_CAPACITY.values())
    load = 6 * capacity
    t0 = time.monotonic()
    outcomes = asyncio.run(load_run(url, (PROMPTS * (load // len(PROMPTS) + 1))[:load]))
    wall = time.monotonic() - t0
    refused = [o for o in outcomes if o.status in (429, 503)]
    accepted = [o for o in outcomes if o.status == 200]
    figures = tally(accepted, reference)
    slowest_refusal = max((o.seconds for o in refused), default=0.0)
    print(f"\n[overload] capacity={capacity} sent={load} accepted={len(accepted)} refused={len(refused)} "
          f"completed={figures['completed']} differing={figures['differing']} "
          f"slowest_refusal={slowest_refusal:.2f}s wall={wall:.1f}s statuses={collections.Counter(o.status for o in outcomes)} "
          f"cuts={[o.cut for o in outcomes if o.cut]}")
    assert refused and len(accepted) + len(refused) == load
    assert figures["completed"] == len(accepted) and figures["differing"] == 0
    for o in refused:
        assert "retry-after" in o.headers and set(o.error) == {"message", "type", "param", "code"}
    # refused at once, not after queueing behind the accepted ones: every refusal came back before the
    # first accepted request finished (an order of events, whatever the machine's speed)
    assert slowest_refusal < min((o.seconds for o in accepted), default=float("inf"))


@pytest.mark.slow
def test_kv_cache_stays_within_budget_in_a_soak(deployed, reference):
    url = deployed("limits")
    peak = {"TargetServer": 0, "DraftServer": 0}
    evictions = {}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for name in peak:
                s = server_stats(name)
                peak[name] = max(peak[name], s["kv_cache_bytes"])
                evictions[name] = s["evictions"]
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    outcomes = []
    t0 = time.monotonic()
    try:
        for i in range(0, 12, 2):  # 12 long sequences, two at a time (the target's capacity)
            outcomes += asyncio.run(load_run(url, [PROMPTS[i % 8], PROMPTS[(i + 1) % 8]], max_tokens=SOAK_N))
    finally:
        stop.set()
        sampler.join(timeout=10)
    figures = tally(outcomes, reference, SOAK_N)
    print(f"\n[kv soak] budget={KV_BUDGET} peak_target={peak['TargetServer']} peak_draft={peak['DraftServer']} "
          f"evictions={evictions} sent={figures['sent']} completed={figures['completed']} "
          f"differing={figures['differing']} wall={time.monotonic() - t0:.1f}s "
          f"errors={[(o.status, o.error, o.cut) for o in outcomes if o.error or o.cut]}")
    assert figures["completed"] == figures["sent"] and figures["differing"] == 0
    assert 0 < peak["TargetServer"] <= KV_BUDGET and 0 < peak["DraftServer"] <= KV_BUDGET


# -- deadlines (no cluster) ----------------------------------------------------------------------
def test_a_request_past_its_deadline_gets_408_and_cancels_its_generation():
    from app.errors import APIError
    from deployments.streams import next_chunk

    class Stuck:
        cancelled = False

        async def __anext__(self):
            await asyncio.sleep(60)

        async def aclose(self):
            self.cancelled = True

    stuck = Stuck()

    async def go():
        deadline = asyncio.get_running_loop().time() + 0.05
        with pytest.raises(APIError) as e:
            await next_chunk(stuck, deadline, 0.05)
        return e.value
    err = asyncio.run(go())
    assert err.status == 408 and err.type == "timeout_error" and stuck.cancelled  # cancel frees the caches


def test_the_target_pools_bounded_queue_fills_before_the_ingress():
    """So overload is answered by the ingress (503, Retry-After, OpenAI's body), not by the proxy's plain text."""
    from cluster.local import load_config

    opts = {d["name"]: d for d in load_config()["applications"][0]["deployments"]}
    target, ingress = opts["TargetServer"], opts["Ingress"]
    most = target["autoscaling_config"]["max_replicas"] * (target["max_ongoing_requests"] + target["max_queued_requests"])
    assert target["max_queued_requests"] > 0
    assert ingress["max_ongoing_requests"] > most
