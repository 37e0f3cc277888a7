"""A model's forwards in process: a 1-row step, a 5-row verify and 16 sequences' steps.

    python -m specserve.bench.steps --target DIR [--dtype bfloat16] [--compile default] [--threads 1] [--reps 12]
    python -m specserve.bench.steps --draft DIR [--packed-weights int8] [--proposal-vocab 49152] ...

`--draft` loads the model as a draft replica does (its proposal head cut to `--proposal-vocab` rows, its
linears packed in `--packed-weights`), so a draft's step is measured as it serves; `--target` as a target.

Each sequence holds `--context` cached positions; each forward adds its rows to them. Prints the
median of the forwards after the first, for the compiled steps (where `--compile` is not off) and for
eager forwards on the same runner, then the figures as JSON. Compare two commits by running this from
each, one after the other on one machine (batch invariance's cost was measured so: docs/performance.md).
"""

import argparse
import json
import statistics
import time

from app.config import DraftSettings, ModelSettings
from app.model.batches import SeqInput
from app.model.loading import load_runner
from app.model.runner import ModelRunner

SHAPES = {"1-row step": (1, 1), "5-row verify": (1, 5), "16 sequences' steps": (16, 1)}  # (sequences, rows each)


def measure(runner: ModelRunner, reps: int, context: int = 200) -> dict[str, float]:
    """Median milliseconds of each shape's forward over `reps` forwards (the first left out)."""
    vocab = runner.vocab_size
    base = [(1000 + i) % vocab for i in range(context)]
    runner.on_thread(runner.forward, [SeqInput(f"s{j}", base + [j], 1) for j in range(16)])
    out = {}
    for name, (sequences, rows) in SHAPES.items():
        times = []
        for i in range(reps):
            seqs = [SeqInput(f"s{j}", base + [j] + [5] * ((i + 1) * rows), rows) for j in range(sequences)]
            started = time.perf_counter()
            runner.on_thread(runner.forward, seqs)
            times.append(time.perf_counter() - started)
        out[name] = round(statistics.median(times[1:]) * 1000, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", help="target model: hub id or local directory")
    which.add_argument("--draft", help="draft model, loaded as a draft replica loads it")
    p.add_argument("--packed-weights", default="model", choices=["model", "bfloat16", "int8", "int4"],
                   help="--draft: the packed linears' weights (a draft's packed_weights)")
    p.add_argument("--proposal-vocab", type=int, default=None, help="--draft: rows of its proposal head")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", default="default", choices=["off", "default"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--context", type=int, default=200)
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error("--reps must be at least 2 (the first forward is left out)")
    if args.target and (args.packed_weights != "model" or args.proposal_vocab):
        p.error("--packed-weights and --proposal-vocab are a draft's (--draft)")
    common = dict(dtype=args.dtype, compile=args.compile, torch_threads=args.threads, max_cache_bytes=512 << 20,
                  compile_in_background=False)
    settings = (DraftSettings(**common, packed_weights=args.packed_weights, proposal_vocab=args.proposal_vocab)
                if args.draft else ModelSettings(**common))
    runner = load_runner(args.draft or args.target, settings, forward_tokens=16 * (args.context + 2))
    report = {}
    if runner.steps is not None:
        report["compiled"] = measure(runner, args.reps, args.context)
    runner.steps = None  # the same runner's eager forwards
    report["eager"] = measure(runner, args.reps, args.context)
    for mode, figures in report.items():
        print(f"{mode:9s}" + "  ".join(f"{name} {ms} ms" for name, ms in figures.items()), flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
