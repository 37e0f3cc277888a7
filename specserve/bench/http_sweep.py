"""The HTTP benchmark: a concurrency sweep against a running server, speculative vs target-only.

At each concurrency C of the sweep, every mode runs the same requests (one per prompt, at least C
of them), at most C in flight, each streamed over SSE with httpx; greedy, EOS ignored. Modes:
    target      speculation off ({"enabled": false}): the baseline
    spec-auto   K chosen by the server's adaptive controller (its default)
    spec-kN     K fixed at N
    peer@HOST   another OpenAI server (--peer URL, e.g. vLLM), sent the same prompts as plain completions

Terms of the report, per (mode, C), beside the in-process ones (TTFT, TPOT, ITL, tau):
    tok/s       aggregate output tokens/s: every token of the level / the level's wall time
    stream      per-stream output tokens/s: the mean over requests of tokens / the request's time
    x           tok/s over target-only's at the same C
    acc, K      accepted / drafted, drafted per round: from the server's `speculation` stats
    fb, Bmax    fallback (plain target) rounds; the largest verify batch any request rode in

Below the table, for our modes, where a round's time went (ms per round, see format_breakdown):
the target replica's round, its forward and the wait for it, the draft's time on and off the
critical path, and the hops the client saw beyond the replica.

Greedy output of a prompt must be the same text in every mode of ours and at every concurrency; a
difference fails the benchmark (ExactnessError). A peer's output is compared for information only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from specserve.bench.figures import (WARMUP_TOKENS, ExactnessError, Timed, differences, fmt, latency_summary, load_prompts,
                           write_outputs)

DEFAULT_MODES = ("target", "spec-auto")
DEFAULT_CONCURRENCY = (1, 4, 16)


class ServerError(RuntimeError):
    """The server answered a request with an error, or could not be reached."""


FAILURES = (ServerError, httpx.HTTPError)  # what ends a sweep with a message, not a traceback


@dataclass
class StreamRun(Timed):
    """One streamed request: its text, timings (seconds from its start) and the server's stats."""

    prompt: int  # index into the prompts
    text: str = ""
    seconds: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    speculation: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.completion_tokens


PEER = "peer@"  # mode name prefix of another OpenAI server, e.g. peer@127.0.0.1:18555


def is_peer(mode: str) -> bool:
    return mode.startswith(PEER)


def speculation_of(mode: str) -> dict | None:
    """The request's `speculation` extension for a mode name (None: a peer, sent plain OpenAI requests)."""
    if is_peer(mode):
        return None
    if mode == "target":
        return {"enabled": False}
    if mode == "spec-auto":
        return {"enabled": True, "num_tokens": "auto"}
    m = re.fullmatch(r"spec-k(\d+)", mode)
    if not m:
        raise ValueError(f"unknown mode {mode!r} for --url: choose from target, spec-auto, spec-kN (N >= 1)")
    return {"enabled": True, "num_tokens": int(m.group(1))}


# --- one request ---------------------------------------------------------------------------


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str, index: int, mode: str,
                            max_tokens: int) -> StreamRun:
    """POST /v1/completions, streamed; note when each text chunk arrives and the final stats."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if speculation_of(mode) is not None:
        body["speculation"] = speculation_of(mode)
    run = StreamRun(index)
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ServerError(f"{mode}: HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            _take_chunk(run, json.loads(line[6:]), time.perf_counter() - t0)
    run.seconds = time.perf_counter() - t0
    if not run.chunk_times or not run.completion_tokens or not (run.speculation or is_peer(mode)):
        raise ServerError(f"{mode}: the stream ended without text or without its usage chunk")
    return run


def _take_chunk(run: StreamRun, chunk: dict, now: float) -> None:
    if "error" in chunk:
        raise ServerError(f"the server failed a request mid-stream: {chunk['error'].get('message')}")
    text = "".join(c.get("text", "") for c in chunk.get("choices", []))
    if text:
        run.text += text
        run.chunk_times.append(now)
    if chunk.get("usage"):
        run.completion_tokens = chunk["usage"]["completion_tokens"]
        run.speculation = chunk.get("speculation") or {}


async def run_level(client: httpx.AsyncClient, model: str, prompts: list[str], mode: str, concurrency: int,
                    max_tokens: int, bar: tqdm | None = None) -> tuple[list[StreamRun], float]:
    """max(len(prompts), concurrency) requests, at most `concurrency` in flight; (runs, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> StreamRun:
        async with gate:
            run = await stream_completion(client, model, prompts[i % len(prompts)], i % len(prompts), mode,
                                          max_tokens)
        if bar is not None:
            bar.update(1)
        return run

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one(i) for i in range(max(len(prompts), concurrency))))
    return list(runs), time.perf_counter() - t0


# --- summarising ---------------------------------------------------------------------------


def summarize_level(runs: list[StreamRun], wall: float, concurrency: int) -> dict:
    """One (mode, concurrency) row: throughput, latencies and the server's speculation stats."""
    tokens = sum(r.num_tokens for r in runs)
    stats = [r.speculation for r in runs]
    rounds = sum(s.get("rounds", 0) for s in stats)
    drafted = sum(s.get("drafted_tokens", 0) for s in stats)
    if not rounds:  # a peer: no speculation stats
        return {"concurrency": concurrency, "requests": len(runs), "output_tokens": tokens, "seconds": wall,
                "output_tokens_per_s": tokens / wall,
                "per_stream_tokens_per_s": sum(r.num_tokens / r.seconds for r in runs) / len(runs),
                **latency_summary(runs), "tau": None, "acceptance_rate": None, "mean_k": None,
                "fallback_rounds": None, "max_target_batch_size": None, "round_ms": None}
    return {
        "concurrency": concurrency,
        "requests": len(runs),
        "output_tokens": tokens,
        "seconds": wall,
        "output_tokens_per_s": tokens / wall,
        "per_stream_tokens_per_s": sum(r.num_tokens / r.seconds for r in runs) / len(runs),
        **latency_summary(runs),
        "tau": sum(s["mean_accepted_length"] * s["rounds"] for s in stats) / rounds if rounds else None,
        "acceptance_rate": sum(s["accepted_tokens"] for s in stats) / drafted if drafted else None,
        "mean_k": drafted / rounds if rounds else 0.0,
        "fallback_rounds": sum(s.get("fallback_rounds", 0) for s in stats),
        "max_target_batch_size": max(s.get("max_target_batch_size", 1) for s in stats),
        "draft_ahead_hit_rate": _weighted(stats, "draft_ahead_hit_rate", rounds),
        "round_ms": round_breakdown(runs, rounds),
    }


def _weighted(stats: list[dict], key: str, rounds: int) -> float:
    return sum(s.get(key, 0.0) * s["rounds"] for s in stats) / rounds


def round_breakdown(runs: list[StreamRun], rounds: int) -> dict:
    """Mean milliseconds per round: where the time went, from the target replica's timings and the client's.

    forward: the target forward a round rode in; queue: waiting for it; draft wait: the proposal's
    time left on the critical path (drafted ahead: ~0); hidden: draft time that overlapped the last
    verify; hops: what the client saw beyond the replica's round (Serve/Ray hops, streaming, HTTP).
    """
    t = {k: sum(r.speculation.get("timing_ms", {}).get(k, 0.0) * r.speculation["rounds"] for r in runs) / rounds
         for k in ("round", "verify", "verify_forward", "draft_wait", "draft_forward", "draft_hidden")}
    client = sum(r.seconds for r in runs) * 1000 / rounds
    return {"client": client, "round": t["round"], "target_forward": t["verify_forward"],
            "target_queue": t["verify"] - t["verify_forward"], "draft_wait": t["draft_wait"],
            "draft_forward": t["draft_forward"], "draft_hidden": t["draft_hidden"],
            "hops": client - t["round"]}


def check_identity(runs: list[StreamRun], reference: dict[int, str], names: list[str], mode: str,
                   concurrency: int) -> list[dict]:
    """Compare each run's text with the first text seen for its prompt (recorded here when new)."""
    for r in runs:
        reference.setdefault(r.prompt, r.text)
    found = differences([r.text for r in runs], [reference[r.prompt] for r in runs], [names[r.prompt] for r in runs])
    if found:
        m = found[0]
        raise ExactnessError(
            f"mode {mode} at concurrency {concurrency}: greedy output differs on {len(found)} request(s); first on "
            f"prompt {m['prompt']!r} at character {m['position']}: expected {m['expected']!r}, got {m['got']!r}")
    return found


def _relative(report: dict) -> None:
    """Speed-up over target-only at the same concurrency."""
    base = report["modes"].get("target", {})
    for rows in report["modes"].values():
        for c, row in rows.items():
            row["speedup"] = row["output_tokens_per_s"] / base[c]["output_tokens_per_s"] if c in base else None


# --- the sweep -----------------------------------------------------------------------------


async def served_model(client: httpx.AsyncClient) -> str:
    """The model name the server lists first."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {client.base_url}: {e}; is `specserve serve` running there?") from None
    if response.status_code == 401:
        raise ServerError(f"GET {client.base_url}/v1/models: HTTP 401: the server wants an API key "
                          "(--api-key, or SPECSERVE_API_KEY in the environment)")
    if response.status_code != 200:
        raise ServerError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["data"][0]["id"]


@dataclass(frozen=True)
class Sweep:
    """What a sweep sends: `prompts` (named `names` in mismatches), in each of `modes` at each concurrency
    of `levels`, answers of `max_tokens` tokens. `peers`: base URLs of other OpenAI servers, sent the
    same prompts as plain completions (their output is compared with ours for information: another
    engine may break float near-ties otherwise)."""
    prompts: list[str]
    names: list[str]
    modes: list[str]
    levels: list[int]
    max_tokens: int
    peers: list[str] = field(default_factory=list)


async def run_sweep(url: str, sweep: Sweep, progress: bool = True, timeout_s: float = 300.0,
                    api_key: str | None = None) -> dict:
    """Every concurrency level, every mode at each (target first, peers last); returns the report.
    `api_key`: sent as a bearer token to every server (ours refuses /v1 without it when it has one)."""
    prompts, names, levels, max_tokens, peers = sweep.prompts, sweep.names, sweep.levels, sweep.max_tokens, sweep.peers
    modes = ["target"] + [m for m in sweep.modes if m != "target"]  # the baseline runs first at every level
    for m in modes:
        speculation_of(m)
    bases = {m: url for m in modes} | {PEER + p.split("://")[-1].rstrip("/"): p.rstrip("/") for p in peers}
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    clients = {m: httpx.AsyncClient(base_url=b, timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers)
               for m, b in bases.items()}
    try:
        names_served = {m: await served_model(c) for m, c in clients.items()}
        report = {"config": {"url": url, "model": names_served["target"], "max_tokens": max_tokens,
                             "prompts": len(prompts), "modes": list(bases), "peers": list(peers),
                             "concurrency": levels, "requests": {str(c): max(len(prompts), c) for c in levels}},
                  "modes": {m: {} for m in bases}}
        reference: dict[int, str] = {}
        total = len(bases) * (1 + sum(max(len(prompts), c) for c in levels))
        with tqdm(total=total, desc="bench", unit="req", disable=not progress, dynamic_ncols=True) as bar:
            for mode, client in clients.items():  # warm-up: allocators, kernels, the controllers' cost estimate
                await stream_completion(client, names_served[mode], prompts[0], 0, mode,
                                        min(max_tokens, WARMUP_TOKENS))
                bar.update(1)
            for c in levels:
                for mode, client in clients.items():
                    bar.set_description(f"bench {mode} x{c}")
                    runs, wall = await run_level(client, names_served[mode], prompts, mode, c, max_tokens, bar)
                    row = summarize_level(runs, wall, c)
                    if is_peer(mode):  # informational: not our output to vouch for
                        found = differences([r.text for r in runs], [reference.get(r.prompt, r.text) for r in runs],
                                            [names[r.prompt] for r in runs])
                    else:
                        found = check_identity(runs, reference, names, mode, c)
                    row["identical"], row["mismatches"] = not found, found
                    report["modes"][mode][str(c)] = row
    finally:
        for client in clients.values():
            await client.aclose()
    _relative(report)
    report["identity_passed"] = True  # a mismatch raised above
    return report


# --- output --------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    """The sweep as a fixed-width table, one row per (concurrency, mode)."""
    head = (f"{'mode':<22}{'conc':>5}{'tok/s':>8}{'stream':>8}{'x':>6}{'TTFT p50/p99':>15}{'TPOT p50/p99':>15}"
            f"{'ITL p50/p99':>15}{'tau':>6}{'acc':>6}{'K':>5}{'fb':>5}{'Bmax':>5}  same")
    lines = [head, "-" * len(head)]
    pair = lambda d: f"{fmt(d['p50'], '.1f')}/{fmt(d['p99'], '.1f')}"  # noqa: E731
    for c in report["config"]["concurrency"]:
        for name, rows in report["modes"].items():
            r = rows[str(c)]
            lines.append(
                f"{name:<22}{c:>5}{r['output_tokens_per_s']:>8.1f}{r['per_stream_tokens_per_s']:>8.1f}"
                f"{fmt(r['speedup']):>6}{pair(r['ttft_ms']):>15}{pair(r['tpot_ms']):>15}{pair(r['itl_ms']):>15}"
                f"{fmt(r['tau']):>6}{fmt(r['acceptance_rate']):>6}{fmt(r['mean_k'], '.1f'):>5}"
                f"{fmt(r['fallback_rounds'], 'd'):>5}{fmt(r['max_target_batch_size'], 'd'):>5}"
                f"  {'yes' if r['identical'] else 'NO'}")
    cfg = report["config"]
    lines.append(f"\n{cfg['url']} ({cfg['model']}): {cfg['prompts']} prompts x {cfg['max_tokens']} tokens, greedy, "
                 f"streamed; requests per level: {cfg['requests']}")
    lines.append("\n" + format_breakdown(report))
    return "\n".join(lines)


BREAKDOWN = (("client", "client"), ("round", "round"), ("target_forward", "t.fwd"), ("target_queue", "t.queue"),
             ("draft_wait", "d.wait"), ("draft_forward", "d.fwd"), ("draft_hidden", "d.hidden"), ("hops", "hops"))


def format_breakdown(report: dict) -> str:
    """Where a round's time goes, ms per round, per (mode, concurrency) of our server."""
    head = f"{'ms per round':<12}{'conc':>5}" + "".join(f"{label:>9}" for _, label in BREAKDOWN) + f"{'ahead hit':>10}"
    lines = [head, "-" * len(head)]
    for c in report["config"]["concurrency"]:
        for name, rows in report["modes"].items():
            r = rows[str(c)]
            if not r.get("round_ms"):
                continue
            lines.append(f"{name:<12}{c:>5}" + "".join(f"{r['round_ms'][k]:>9.2f}" for k, _ in BREAKDOWN)
                         + f"{fmt(r.get('draft_ahead_hit_rate')):>10}")
    lines.append("client: request time / rounds as the client saw it; round: the target replica's round; t.fwd, "
                 "t.queue: its target forward and the wait for it; d.wait: waiting for the proposal; d.fwd: the draft "
                 "forward; d.hidden: draft time hidden behind the previous verify; hops: client - round (Serve/Ray "
                 "hops, streaming, HTTP)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Two panels: aggregate and per-stream output tokens/s against concurrency, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["config"]["concurrency"]
    fig, (total, stream) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in report["modes"].items():
        style = {"color": "tab:gray"} if name == "target" else {}
        for ax, key in ((total, "output_tokens_per_s"), (stream, "per_stream_tokens_per_s")):
            ax.plot(levels, [rows[str(c)][key] for c in levels], marker="o", label=name, **style)
    for ax, title in ((total, "aggregate"), (stream, "per stream")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"throughput, {title}")
        ax.legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['url']} ({cfg['model']}): {cfg['prompts']} prompts x {cfg['max_tokens']} tokens, greedy, "
                 "streamed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; each level >= 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text!r}: give comma-separated integers >= 1, e.g. 1,4,16")
    return levels


def url_cli(args) -> int:
    """`specserve bench --url`: the concurrency sweep against a running server; 1 on a mismatch or error."""
    modes = [m.strip() for m in (args.modes or ",".join(DEFAULT_MODES)).split(",") if m.strip()]
    try:
        levels = parse_levels(args.concurrency)
        for m in modes:
            speculation_of(m)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts, names = load_prompts(args.prompts, args.num_prompts)
    try:
        sweep = Sweep(prompts, names, modes, levels, args.max_tokens, list(args.peer or []))
        api_key = args.api_key or os.environ.get("SPECSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        report = asyncio.run(run_sweep(args.url.rstrip("/"), sweep, not args.no_progress, args.request_timeout,
                                       api_key))
    except (ExactnessError, *FAILURES) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    write_outputs(report, args.json, args.plot, plot)
    return 0
