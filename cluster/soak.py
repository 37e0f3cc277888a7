"""Chaos soak: mixed load on a local cluster running two replicas of every deployment, while a random
replica of a random layer is killed every 20-40 s. Per layer killed it reports what the clients saw.

    .venv/bin/python -m cluster.soak --minutes 10 [--target DIR --draft DIR] [--tp 2] [--seed 0 1 2] [--json out.json]
    .venv/bin/python -m cluster.soak --overload 4     (4x the target pool's capacity at once, instead)

The load: `--clients` loops, each sending requests drawn from a fixed mix (streaming or not; greedy,
seeded or unseeded sampling; short or long prompts). Before the first kill every greedy and seeded
request of the mix is answered once by the undisturbed app: its reference. During the soak such a
request must come back identical (durable state is what was streamed: a request resumed elsewhere
continues exactly). Layers: draft and target replicas, TP ranks (with --tp 2), and the ingress,
which holds the request router (a plain class in the ingress process, not a deployment of its own):
its streams continue on another ingress replica through the proxy's failover (deployments/failover.py).

Each request is counted against the last kill before it ended, when it ended within 30 s of it
(else against "no kill"): sent, completed, identical to the reference, clear errors (an OpenAI
error body, or an SSE error event), dropped connections (the client library raises: a body cut
mid-stream, or the HTTP proxy's own 500 when the ingress replica under it died), silent cuts (a
response that ended cleanly without a finish or an error: must be 0), and latency p50/p99; for each
request that differs, `differences` in the JSON report: both texts, the first differing character, the
kill, and where its stream paused longest (a resumed cut, as far as a client can see one). No
layer it kills may drop a connection: only the death of the HTTP proxy itself, which holds them, could.
"""

import argparse
import asyncio
import json
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

import httpx

LAYERS = {"draft": "DraftServer", "target": "TargetServer", "ingress": "Ingress"}
WINDOW_S = 30.0  # a kill's effects are counted for the requests that end this long after it
SHORT = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(", "x = [", "# sort a list\n"]
# long enough to take several forwards of a small model's prefill, short enough for a 512-token context
LONG = ["def merge_sort(items):\n    \"\"\"Sort items with merge sort.\"\"\"\n" + "    # step\n" * 24,
        "The history of computing began long before electronic machines. " * 5]


@dataclass(frozen=True)
class Spec:
    """One request of the mix."""

    prompt: str
    kind: str  # greedy | seeded | unseeded
    stream: bool
    max_tokens: int

    def body(self) -> dict:
        sampling = {"temperature": 0} if self.kind == "greedy" else {"temperature": 0.9, "top_p": 0.95}
        if self.kind == "seeded":
            sampling["seed"] = zlib.crc32(self.prompt.encode()) % 10_000
        return {"model": "target", "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": self.stream, **sampling}


@dataclass
class Outcome:
    spec: Spec
    start: float
    end: float = 0.0
    status: int = 0
    text: str = ""
    finished: bool = False
    error: dict | None = None  # a clear failure: OpenAI's error body or an SSE error event
    dropped: str | None = None  # the connection failed: a transport error, or the proxy's own 5xx
    retry_after: str | None = None  # the Retry-After header of a refusal
    cut: str | None = None  # a silent cut: ended cleanly with neither a finish nor an error
    events: list[tuple[float, int]] = field(default_factory=list)  # a stream's events: (s since start, chars so far)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def mix(max_tokens: int) -> list[Spec]:
    return [Spec(p, kind, stream, max_tokens) for p in SHORT + LONG for kind in ("greedy", "seeded", "unseeded")
            for stream in (True, False)]


async def sse_events(response: httpx.Response):
    """The JSON events of a server-sent-events response, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def take_event(out, event: dict) -> None:
    """Apply one streamed event to an outcome (anything with text, finished and error)."""
    if "error" in event:
        out.error = event["error"]
        return
    for choice in event["choices"]:
        out.text += choice["text"]
        out.finished |= choice["finish_reason"] is not None


async def send(client: httpx.AsyncClient, url: str, spec: Spec) -> Outcome:
    """One request, read to its end; what the client saw."""
    out = Outcome(spec, time.monotonic())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=spec.body()) as r:
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200 or not spec.stream:
                raw = await r.aread()
                try:
                    body = json.loads(raw)
                except ValueError:  # the HTTP proxy's own answer (its replica died under it)
                    out.dropped = f"{r.status_code} from the proxy: {raw[:60]!r}"
                    return out
                if "error" in body:
                    out.error = body["error"]
                elif "choices" in body:
                    out.text, out.finished = body["choices"][0]["text"], True
                else:
                    out.cut = f"{r.status_code}: neither a completion nor an error"
                return out
            async for event in sse_events(r):
                take_event(out, event)
                out.events.append((time.monotonic() - out.start, len(out.text)))
        if not (out.finished or out.error):
            out.cut = "the stream ended without a finish or an error"
    except httpx.HTTPError as e:  # the client library raises: the connection broke, not a silent end
        out.dropped = f"{type(e).__name__}: {e}"
    finally:
        out.end = time.monotonic()
    return out


async def load(url: str, specs: list[Spec], clients: int, until: float, seed: int,
               timeout_s: float) -> list[Outcome]:
    """`clients` loops sending random requests of the mix until `until` (monotonic); each bounded in time."""
    outcomes: list[Outcome] = []

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            while time.monotonic() < until:
                outcomes.append(await send(client, url, rng.choice(specs)))
    await asyncio.gather(*(loop(i) for i in range(clients)))
    return outcomes


def replicas_of(layer: str) -> list[str]:
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    if layer == "rank":
        return sorted(a["name"] for a in actors if a["name"].startswith("specserve-rank-"))
    return sorted(a["name"] for a in actors if a["namespace"] == "serve" and f"#{LAYERS[layer]}#" in a["name"])


def kill(layer: str, rng: random.Random) -> str:
    """Kill one replica (process) of a layer; Serve (or its TargetServer, for a rank) replaces it."""
    import ray

    name = rng.choice(replicas_of(layer))
    namespace = None if layer == "rank" else "serve"
    ray.kill(ray.get_actor(name, namespace=namespace) if namespace else _actor(name), no_restart=True)
    return name


def _actor(name: str):
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == name:
            return ray.get_actor(name, namespace=a["namespace"])
    raise LookupError(name)


def chaos(layers: list[str], until: float, every: tuple[float, float], seed: int, kills: list, stop: threading.Event,
          in_turn: bool = False):
    """Kill a random replica of a random layer (`in_turn`: of each layer in turn) every `every` seconds
    until `until`; records (time, layer, name)."""
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(*every)) and time.monotonic() < until - every[0]:
        layer = layers[len(kills) % len(layers)] if in_turn else rng.choice(layers)
        try:
            kills.append((time.monotonic(), layer, kill(layer, rng)))
        except Exception as e:  # nothing of that layer up at the moment (a replacement still starting)
            kills.append((time.monotonic(), layer, f"not killed: {e}"))
        print(f"  kill {kills[-1][1]}: {kills[-1][2]}", flush=True)


def tally(outcomes: list[Outcome], kills: list, references: dict) -> dict:
    """Per layer (and "no kill"): the figures the soak reports."""
    rows: dict[str, list[Outcome]] = {}
    for o in outcomes:
        kill = last_kill(o, kills)
        rows.setdefault(kill[1] if kill else "no kill", []).append(o)
    table = {}
    for layer, os_ in sorted(rows.items()):
        checked = [o for o in os_ if o.spec in references and o.finished and not o.error]
        seconds = sorted(o.seconds for o in os_ if o.finished and not o.error)
        table[layer] = {
            "kills": sum(1 for k in kills if k[1] == layer and not k[2].startswith("not")),
            "sent": len(os_), "completed": sum(o.finished and not o.error for o in os_),
            "checked": len(checked), "identical": sum(o.text == references[o.spec] for o in checked),
            "clear_errors": sum(o.error is not None for o in os_),
            "dropped": sum(o.dropped is not None for o in os_),
            "silent_cuts": sum(o.cut is not None and o.error is None for o in os_),
            "p50_s": round(seconds[len(seconds) // 2], 2) if seconds else None,
            "p99_s": round(seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))], 2) if seconds else None,
            "differing": sorted({name(o.spec) for o in checked if o.text != references[o.spec]}),
            "differences": [difference(o, references[o.spec], last_kill(o, kills)) for o in checked
                            if o.text != references[o.spec]],
            "errors": sorted({f"{o.status} {o.error.get('code')}: {o.error['message'][:50]}" for o in os_ if o.error}),
            "cuts": sorted({o.cut[:80] for o in os_ if o.cut})[:5],
            "drops": sorted({o.dropped[:80] for o in os_ if o.dropped})[:5],
        }
    return table


def last_kill(o: Outcome, kills: list) -> tuple | None:
    """The kill a request is counted against: the last one before it ended, within WINDOW_S."""
    last = [k for k in kills if k[0] <= o.end and o.end - k[0] <= WINDOW_S and not k[2].startswith("not")]
    return last[-1] if last else None


def name(spec: Spec) -> str:
    return f"{spec.kind} stream={spec.stream} {spec.prompt[:20]!r}"


def difference(o: Outcome, reference: str, kill: tuple | None) -> dict:
    """A request that differs from its reference, as its client saw it: both texts, where they part, and
    where its stream paused longest. The failover's markers (its resume state: token ids, characters)
    never reach the client, and completions carry no token ids; a cut resumed on another ingress
    shows as that pause: the events and characters received before it."""
    at = next((i for i, (a, b) in enumerate(zip(o.text, reference)) if a != b), min(len(o.text), len(reference)))
    row = {"request": name(o.spec), "reference": reference, "got": o.text, "first_differing_char": at,
           "seconds": round(o.seconds, 3)}
    if kill is not None:
        row["kill"] = {"layer": kill[1], "replica": kill[2], "s_after_start": round(kill[0] - o.start, 3)}
    if len(o.events) > 1:
        pause, i = max((b[0] - a[0], i) for i, (a, b) in enumerate(zip(o.events, o.events[1:]), 1))
        row["longest_pause"] = {"seconds": round(pause, 3), "events_before": i, "chars_before": o.events[i - 1][1],
                                "at_s": round(o.events[i - 1][0], 3), "events": len(o.events)}
    return row


def markdown(table: dict) -> str:
    keys = ["kills", "sent", "completed", "checked", "identical", "clear_errors", "dropped", "silent_cuts", "p50_s",
            "p99_s"]
    lines = ["| layer killed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {layer} | " + " | ".join(str(row[k]) for k in keys) + " |" for layer, row in table.items()]
    return "\n".join(lines)


def soak_config(target: str, draft: str, port: int, tp: int) -> dict:
    from cluster.local import load_config

    args = {"target": {"model": target, "dtype": "float32", "tensor_parallel_size": tp}, "draft": {"model": draft},
            "speculation": {"draft_timeout_s": 5.0, "draft_retry_after_s": 1.0}}
    config = load_config(args=args, port=port)
    for d in config["applications"][0]["deployments"]:
        d.pop("autoscaling_config", None)
        d["num_replicas"] = 2
    return config


@dataclass(frozen=True)
class Soak:
    """One soak: `seconds` of `clients` clients sending the mix (answers of up to `max_tokens` tokens),
    a replica killed every `every` seconds (`in_turn`: of each layer in turn, else of a random one),
    targets of `tp` tensor-parallel ranks; `seed` draws the kills and the load."""
    seconds: float
    clients: int = 4
    tp: int = 1
    seed: int = 0
    every: tuple[float, float] = (20.0, 40.0)
    max_tokens: int = 32
    in_turn: bool = False


def run(target: str, draft: str, soak: Soak, port: int = 8011, timeout_s: float = 120.0, cluster=None) -> dict:
    """Start a local cluster, deploy two replicas of everything, soak as `soak` says; the report.
    `cluster`: a context to deploy in instead (a cluster already running, whose proxy listens on `port`);
    the app is left on it."""
    from cluster.local import LocalCluster, deploy

    seconds, clients, seed, every = soak.seconds, soak.clients, soak.seed, soak.every
    specs = mix(soak.max_tokens)
    layers = list(LAYERS) + (["rank"] if soak.tp > 1 else [])
    with cluster or LocalCluster():
        deploy(soak_config(target, draft, port, soak.tp), timeout_s=600)
        url = f"http://127.0.0.1:{port}"
        print(f"app up at {url}: references for {sum(s.kind != 'unseeded' for s in specs)} requests...", flush=True)

        async def references() -> dict:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                done = [await send(client, url, s) for s in specs if s.kind != "unseeded"]
            return {o.spec: o.text for o in done if o.finished and not o.error}
        refs = asyncio.run(references())
        print(f"soaking for {seconds:.0f}s with {clients} clients; kills every {every[0]:.0f}-{every[1]:.0f}s of "
              f"{', '.join(layers)}", flush=True)
        until, kills, stop = time.monotonic() + seconds, [], threading.Event()
        killer = threading.Thread(target=chaos, args=(layers, until, every, seed, kills, stop, soak.in_turn),
                                  daemon=True)
        killer.start()
        try:
            outcomes = asyncio.run(load(url, specs, clients, until, seed, timeout_s))
        finally:
            stop.set()
            killer.join(timeout=60)
    table = tally(outcomes, kills, refs)
    return {"seconds": seconds, "clients": clients, "tp": soak.tp, "seed": seed,
            "kills": [(round(t - kills[0][0], 1) if kills else 0, l, n) for t, l, n in kills],
            "references": len(refs), "table": table}


def overload(target: str, draft: str, factor: int = 4, running: int = 4, queued: int = 4, max_tokens: int = 32,
             port: int = 8011, timeout_s: float = 300.0) -> dict:
    """`factor` times the target pool's capacity at once (two replicas, each running `running` requests
    and queueing `queued`): every answer must be a completion or a 503/429 with Retry-After, and every
    accepted request must complete identically to the same request sent alone."""
    from cluster.local import LocalCluster, deploy

    config = soak_config(target, draft, port, 1)
    for d in config["applications"][0]["deployments"]:
        if d["name"] == "TargetServer":
            d.update(max_ongoing_requests=running, max_queued_requests=queued)
    capacity = 2 * (running + queued)
    specs = [s for s in mix(max_tokens) if s.kind == "greedy"]
    burst = [specs[i % len(specs)] for i in range(factor * capacity)]
    with LocalCluster():
        deploy(config, timeout_s=600)
        url = f"http://127.0.0.1:{port}"

        async def go():
            async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None)) as client:
                refs = {s: (await send(client, url, s)).text for s in specs}
                outcomes = await asyncio.gather(*(send(client, url, s) for s in burst))
            return refs, outcomes
        refs, outcomes = asyncio.run(go())
    accepted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status in (429, 503)]
    return {"capacity": capacity, "sent": len(outcomes), "accepted": len(accepted),
            "completed": sum(o.finished and not o.error for o in accepted),
            "identical": sum(o.finished and o.text == refs[o.spec] for o in accepted),
            "refused": len(refused), "refused_with_retry_after": sum(o.retry_after is not None for o in refused),
            "refused_openai_body": sum(o.error is not None for o in refused),
            "other": sorted({f"{o.status} {o.dropped or o.cut or ''}" for o in outcomes
                             if o.status not in (200, 429, 503) or o.dropped or o.cut}),
            "slowest_refusal_s": round(max((o.seconds for o in refused), default=0.0), 2),
            "fastest_completion_s": round(min((o.seconds for o in accepted if o.finished), default=0.0), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--target", help="target model directory (default: the demo target)")
    p.add_argument("--draft", help="draft model directory (default: the demo draft)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica (2 adds rank kills)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, nargs="+", default=[0],
                   help="seeds of the kills and the load; several soak one after another, each on a fresh cluster")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--overload", type=int, metavar="FACTOR",
                   help="instead of the soak: FACTOR x the target pool's capacity at once (capacity kept small)")
    args = p.parse_args(argv)
    from specserve.demo import models

    target, draft = models(args.target, args.draft, "demo")
    if args.overload:
        report = overload(target, draft, args.overload, max_tokens=args.max_tokens)
        print(json.dumps(report, indent=1))
        ok = report["completed"] == report["identical"] == report["accepted"] and not report["other"] \
            and report["refused"] == report["refused_with_retry_after"] == report["refused_openai_body"]
        return 0 if ok else 1
    reports = []
    for seed in args.seed:
        report = run(target, draft, Soak(args.minutes * 60, args.clients, args.tp, seed, max_tokens=args.max_tokens))
        print(f"seed {seed}:\n{markdown(report['table'])}")
        for layer, row in report["table"].items():
            if row["errors"] or row["cuts"] or row["drops"] or row["differing"]:
                print(f"{layer}: errors {row['errors']} drops {row['drops']} cuts {row['cuts']} "
                      f"differing {row['differing']}")
        reports.append(report)
        if args.json:  # written after each seed: a long run's earlier seeds survive a later failure
            with open(args.json, "w") as f:
                json.dump(reports[0] if len(args.seed) == 1 else {"runs": reports}, f, indent=1)
    return 0 if all(lost_nothing(r["table"]) for r in reports) else 1


def lost_nothing(table: dict) -> bool:
    """The soak's promise: no silent cut, no dropped connection and no differing output, whatever was killed."""
    return all(row["silent_cuts"] == 0 and row["dropped"] == 0 and row["identical"] == row["checked"]
               for row in table.values())


if __name__ == "__main__":
    raise SystemExit(main())
