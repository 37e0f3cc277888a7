"""A recipe trial: build a demo pair from the full plan with some fields changed, and measure it.

    python -m specserve.demo.trial OUT '{"target_steps": 400, "target": {"layers": 4, "hidden": 256,
                                   "intermediate": 768, "heads": 4}}'

Prints one JSON line: the build's phase times and compute dtype, held-out loss of the target,
the share of distinct 4-grams in its greedy text, τ at K = 4 and c (docs/demo-pair.md's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch

from specserve.demo import build, measure, train


def trial_plan(changes: dict) -> train.BuildPlan:
    """The full plan with `changes` applied (model shapes as dicts of ModelShape's fields)."""
    shaped = {k: train.ModelShape(**v) if k in ("target", "draft") else v for k, v in changes.items()}
    return dataclasses.replace(train.PLANS["full"], **shaped)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.demo.trial", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory to build into (replaced)")
    p.add_argument("changes", nargs="?", default="{}", help="JSON object of BuildPlan fields to change")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    build.build_pair(args.out, seed=args.seed, plan=trial_plan(json.loads(args.changes)))
    info = json.loads((args.out / build.MARKER).read_text())
    torch.set_num_threads(2)
    m = measure.measure_pair(str(args.out / "target"), str(args.out / "draft"))
    print(json.dumps({
        "changes": json.loads(args.changes), "compute_dtype": info["compute_dtype"],
        "build_seconds": info["build_seconds"], "phase_seconds": info["phase_seconds"],
        "heldout_loss": round(measure.heldout_loss(str(args.out / "target")), 3),
        "distinct_4grams": round(m["distinct_4grams"], 3), "tau": round(m["tau"], 3), "c": round(m["c"], 3),
        "target_params": m["target_params"], "draft_params": m["draft_params"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
