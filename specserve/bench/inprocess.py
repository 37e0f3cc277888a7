"""The in-process benchmark: one pair, the same prompts, greedy, one request at a time.

Modes (each after one warm-up):
    target          speculation off (K = 0) through the same engine: the baseline and the reference
    spec-k2/4/6     speculative decoding, K fixed
    spec-auto       speculative decoding, K chosen by the controller
    hf-assisted     Hugging Face assisted generation with the same loaded models, its defaults
    hf-assisted-k4  ... with K matched: 4 assistant tokens, constant schedule, no confidence stop
    hf-target       Hugging Face `generate` of the target alone: a sanity reference

Terms of the report:
    TTFT   time to the first output token; TPOT (end - TTFT) / (tokens - 1), per request
    ITL    time between consecutive streamed chunks (a round streams all its tokens at once)
    tau    tokens per target forward, the bonus / recovered token included
    alpha  per-token acceptance, maximum likelihood: accepted / (accepted + rejections); the
           engine's acceptance_rate = accepted / drafted is biased low by runs cut at a rejection
    c      draft step / target step, timed directly (batch 1, one token over a KV cache)
    bound  Leviathan's expected speed-up for (alpha, K, c); efficiency = measured speed-up / bound

Greedy output of every mode of ours must be token-identical to `target`; a difference fails the
benchmark (ExactnessError). Hugging Face modes are compared too, and their differences reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from tqdm.auto import tqdm

from app.speculation.controller import CostEstimator, expected_speedup
from app.engine import Engine
from specserve.bench.runs import MODES, Mode, PromptRun, measure_costs, measure_syncs, run_one
from specserve.bench.figures import (WARMUP_TOKENS, ExactnessError, differences, fmt, latency_summary, load_prompts,
                           write_outputs)


# --- summarising ---------------------------------------------------------------------------


def _bound(alpha: float, mean_k: float, c: float) -> float:
    """Leviathan's expected speed-up; a fractional mean K interpolates between its neighbours."""
    lo = int(mean_k)
    frac = mean_k - lo
    low = expected_speedup(alpha, lo, c)
    return low if frac < 1e-9 else (1 - frac) * low + frac * expected_speedup(alpha, lo + 1, c)


def speculation_summary(runs: list[PromptRun], c: float) -> dict:
    """tau, acceptance (overall, per position, MLE alpha), mean K and the bound over all rounds."""
    rounds = [r for run in runs for r in run.rounds]
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    rejections = sum(1 for r in rounds if r.accepted < r.drafted)
    depth = max((r.drafted for r in rounds), default=0)
    by_position = [sum(r.accepted > j for r in rounds) / max(1, sum(r.drafted > j for r in rounds))
                   for j in range(depth)]
    alpha = accepted / (accepted + rejections) if drafted else 0.0
    mean_k = drafted / len(rounds) if rounds else 0.0
    return {
        "rounds": len(rounds),
        "tau": sum(r.emitted for r in rounds) / len(rounds) if rounds else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "alpha": alpha if drafted else None,
        "acceptance_by_position": by_position,
        "mean_k": mean_k,
        "bound": _bound(alpha, mean_k, c),
    }


def summarize(mode: Mode, runs: list[PromptRun], costs: dict) -> dict:
    """One mode's row of the report (speed-up, efficiency and identity are filled in later)."""
    tokens = sum(r.num_tokens for r in runs)
    row = {
        "output_tokens": tokens,
        "seconds": sum(r.seconds for r in runs),
        "output_tokens_per_s": tokens / sum(r.seconds for r in runs),
        **latency_summary(runs),
        "c_measured": costs["c"],
        "c_estimator": None,
    }
    if not mode.hf:
        row |= speculation_summary(runs, costs["c"])
    else:
        chunks = [s for r in runs for s in r.chunk_sizes]
        row |= {"rounds": len(chunks), "tau": sum(chunks) / len(chunks), "acceptance_rate": None, "alpha": None,
                "acceptance_by_position": [], "mean_k": None, "bound": None}
    return row


def mismatches(runs: list[PromptRun], reference: list[PromptRun], prompt_ids: list[str]) -> list[dict]:
    """Where each output first differs from the reference's, per prompt."""
    return differences([r.tokens for r in runs], [r.tokens for r in reference], prompt_ids)


# --- the benchmark -------------------------------------------------------------------------


def fit_prompts(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Tokenize; keep each prompt's last tokens when prompt + max_tokens would pass a context limit."""
    limit = min(engine.target.max_context, engine.draft.max_context) - max_tokens - 1
    if limit < 1:
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt in the context "
                         f"of {limit + max_tokens + 1} tokens: lower it")
    ids = [engine.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    return [i[-limit:] for i in ids]


def run_bench(engine: Engine, prompts: list[str], prompt_names: list[str], modes: list[str],
              max_tokens: int, progress: bool = True, cost_steps: int = 20) -> dict:
    """Run every mode over every prompt (after a warm-up each); returns the report."""
    modes = ["target"] + [m for m in modes if m != "target"]  # the reference runs first
    ids = fit_prompts(engine, prompts, max_tokens)
    context = int(statistics.median(len(i) for i in ids)) + max_tokens // 2
    costs = measure_costs(engine, context, [2, 4, 6], cost_steps)
    report = {"config": {"max_tokens": max_tokens, "prompts": len(ids), "modes": modes,
                         "target_dtype": str(engine.target.model.dtype), "draft_dtype": str(engine.draft.model.dtype),
                         "device": str(engine.target.device), "threads": torch.get_num_threads()},
              "costs": costs, "syncs": measure_syncs(engine, ids[:16]), "modes": {}}
    runs_by_mode: dict[str, list[PromptRun]] = {}
    with tqdm(total=len(modes) * (len(ids) + 1), desc="bench", unit="req", disable=not progress,
              dynamic_ncols=True) as bar:
        for name in modes:
            mode = MODES[name]
            bar.set_description(f"bench {name}")
            engine.costs = CostEstimator()  # each mode's estimate of c is its own
            run_one(engine, ids[0], mode, min(max_tokens, WARMUP_TOKENS))
            bar.update(1)
            runs = []
            for i in ids:
                runs.append(run_one(engine, i, mode, max_tokens))
                bar.update(1)
            runs_by_mode[name] = runs
            row = summarize(mode, runs, costs)
            if not mode.hf and name != "target":
                row["c_estimator"] = engine.costs.c
            found = mismatches(runs, runs_by_mode["target"], prompt_names)
            row["identical"], row["mismatches"] = not found, found
            report["modes"][name] = row
            if found and not mode.hf:
                m = found[0]
                raise ExactnessError(
                    f"mode {name}: greedy output differs from target-only on {len(found)} prompt(s); first on "
                    f"prompt {m['prompt']!r} at output token {m['position']}: expected {m['expected']}, "
                    f"got {m['got']}")
    _relative(report)
    return report


def _relative(report: dict) -> None:
    """Speed-up over target-only and efficiency against the bound."""
    base = report["modes"]["target"]["output_tokens_per_s"]
    for row in report["modes"].values():
        row["speedup"] = row["output_tokens_per_s"] / base
        row["efficiency"] = row["speedup"] / row["bound"] if row["bound"] else None
    report["identity_passed"] = all(r["identical"] for n, r in report["modes"].items() if not MODES[n].hf)


# --- output --------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    """The report as a fixed-width table, per-position acceptance and costs below it."""
    head = (f"{'mode':<15}{'tok/s':>8}{'x':>6}{'TTFT p50/p99':>15}{'TPOT p50/p99':>15}{'ITL p50/p99':>15}"
            f"{'tau':>6}{'acc':>6}{'alpha':>6}{'K':>5}{'c_est':>7}{'bound':>7}{'eff':>6}  same")
    lines = [head, "-" * len(head)]
    for name, r in report["modes"].items():
        pair = lambda d: f"{fmt(d['p50'], '.1f')}/{fmt(d['p99'], '.1f')}"
        lines.append(
            f"{name:<15}{r['output_tokens_per_s']:>8.1f}{r['speedup']:>6.2f}{pair(r['ttft_ms']):>15}"
            f"{pair(r['tpot_ms']):>15}{pair(r['itl_ms']):>15}{fmt(r['tau']):>6}{fmt(r['acceptance_rate']):>6}"
            f"{fmt(r['alpha']):>6}{fmt(r['mean_k'], '.1f'):>5}{fmt(r['c_estimator'], '.3f'):>7}"
            f"{fmt(r['bound']):>7}{fmt(r['efficiency']):>6}  {'yes' if r['identical'] else 'NO'}")
    lines.append("")
    for name, r in report["modes"].items():
        if r["acceptance_by_position"]:
            lines.append(f"acceptance by position  {name:<10} "
                         + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    c = report["costs"]
    verify = ", ".join(f"K={k}: {v:.2f}" for k, v in c["target_verify_ms"].items())
    lines.append(f"costs at context {c['context']}: target step {c['target_step_ms']:.2f} ms, draft step "
                 f"{c['draft_step_ms']:.2f} ms, c = {c['c']:.3f}; target verify (K+1 tokens) {verify} ms")
    for name, r in report["modes"].items():
        for m in r["mismatches"][:3]:
            lines.append(f"MISMATCH {name}: prompt {m['prompt']} at token {m['position']}: "
                         f"expected {m['expected']} got {m['got']} (lengths {m['lengths']})")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Two panels: output tokens/s by mode; acceptance by draft position for the speculative modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["modes"]
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(rows)
    colors = ["tab:gray" if n == "target" else "tab:orange" if MODES[n].hf else "tab:blue" for n in names]
    bars = speed.bar(names, [rows[n]["output_tokens_per_s"] for n in names], color=colors)
    speed.bar_label(bars, labels=[f"{rows[n]['speedup']:.2f}x" for n in names], fontsize=8)
    speed.set_ylabel("output tokens/s")
    speed.set_title("throughput, single stream")
    speed.tick_params(axis="x", rotation=30)
    for n in names:
        acc = rows[n]["acceptance_by_position"]
        if acc:
            accept.plot(range(1, len(acc) + 1), acc, marker="o", label=n)
    accept.set_xlabel("draft position j")
    accept.set_ylabel("P(accepted at j | drafted >= j)")
    accept.set_ylim(0, 1.02)
    accept.set_title("acceptance by position")
    if accept.lines:
        accept.legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['prompts']} prompts x {cfg['max_tokens']} tokens, greedy; target {cfg['target_dtype']}, "
                 f"draft {cfg['draft_dtype']}, {cfg['device']}, {cfg['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------


def add_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `specserve bench`."""
    p.add_argument("--prompts", help="jsonl with a \"prompt\" field, or plain text lines (default: held-out set)")
    p.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--target", help="target model: hub id or local directory (default: the demo target)")
    p.add_argument("--draft", help="draft model: hub id or local directory (default: the demo draft)")
    p.add_argument("--pair", choices=("smollm2", "demo"), default="smollm2",
                   help="the built pair used when no model is named (default smollm2)")
    p.add_argument("--quick", action="store_true", help="use the small, quickly built toy pair")
    p.add_argument("--dtype", default="float32",
                   help="target dtype: float32 (default: greedy identity is exact), bfloat16 (faster; batched and "
                        "stepwise forwards may break bf16 near-ties differently), float16 or auto")
    p.add_argument("--draft-dtype", default="float32", help="draft dtype")
    p.add_argument("--device", default="cpu", help="torch device of both models")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    p.add_argument("--compile", default="off", choices=["off", "default", "reduce-overhead"],
                   help="in process: both models' steps as compiled graphs (app/model/compiled.py), compiled before timing")
    p.add_argument("--draft-ahead", action="store_true",
                   help="in process: draft round n+1 while round n verifies (off by default in process: EngineConfig.speculation.draft_ahead)")
    p.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)} (default: all); with --url: "
                   "target, spec-auto, spec-kN (default: target,spec-auto)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", default="bench.png", help="write the two-panel plot here (PNG)")
    p.add_argument("--url", help="benchmark the server running there over HTTP (e.g. http://127.0.0.1:8000): "
                   "a concurrency sweep; the model options are then unused")
    p.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="with --url: another OpenAI server (e.g. vLLM) sent the same prompts at every level, its "
                        "figures side by side with ours; repeatable")
    p.add_argument("--concurrency", default="1,4,16", help="with --url: concurrent streams per level")
    p.add_argument("--request-timeout", type=float, default=300.0, help="with --url: seconds per request")
    p.add_argument("--api-key", default=None,
                   help="with --url: sent as a bearer token to every server of the sweep (default: "
                        "$SPECSERVE_API_KEY, then $OPENAI_API_KEY, then none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _load(args) -> Engine:
    from specserve.demo import models

    target, draft = models(args.target, args.draft, "quick" if args.quick else args.pair)
    return Engine.from_pretrained(target, draft, dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device,
                                  draft_ahead=args.draft_ahead, compile=args.compile)


def bench_cli(args) -> int:
    """`specserve bench`: run the modes, print the table, write --json and --plot; 1 on a mismatch."""
    modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"error: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF's per-call generation notices would drown the table
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, names = load_prompts(args.prompts, args.num_prompts)
    engine = _load(args)
    try:
        report = run_bench(engine, prompts, names, modes, args.max_tokens, progress=not args.no_progress)
    except ExactnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    syncs = report["syncs"]
    print(f"host syncs per round (a batch of {syncs['batch']}, K = {syncs['k']} and the guess), device reads / "
          "uploads: " + "; ".join(
              f"{name}: draft propose {syncs[name]['propose']} / {syncs[name]['propose_uploads']}, "
              f"target verify {syncs[name]['verify']} / {syncs[name]['verify_uploads']}" for name in ("greedy", "sampled")))
    write_outputs(report, args.json, args.plot, plot)
    return 0
