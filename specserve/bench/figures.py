"""What the in-process and the HTTP benchmark share: request timings, percentiles, the exactness
check against the reference, the prompts, and number formatting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WARMUP_TOKENS = 32  # enough rounds to warm allocators, kernels and the cost estimator


class ExactnessError(RuntimeError):
    """A greedy output of ours differs from plain greedy decoding of the target."""


class Timed:
    """TTFT, TPOT and ITLs of a request from `seconds`, `chunk_times` and `num_tokens` (in process or HTTP)."""

    seconds: float
    chunk_times: list[float]  # when each token-bearing chunk arrived, seconds from the request's start

    @property
    def num_tokens(self) -> int:
        raise NotImplementedError

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def tpot(self) -> float | None:
        n = self.num_tokens
        return (self.seconds - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


def pcts(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)) * 1e3, "p99": float(np.percentile(values, 99)) * 1e3}


def latency_summary(runs: list[Timed]) -> dict:
    """TTFT, TPOT and ITL percentiles (ms) over requests."""
    return {
        "ttft_ms": pcts([r.ttft for r in runs]),
        "tpot_ms": pcts([r.tpot for r in runs if r.tpot is not None]),
        "itl_ms": pcts([x for r in runs for x in r.itls]),
    }


def differences(outputs: list, reference: list, prompt_ids: list[str]) -> list[dict]:
    """Where each output (token ids, or text) first differs from the reference's, per prompt."""
    found = []
    for pid, out, ref in zip(prompt_ids, outputs, reference):
        if out != ref:
            at = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            found.append({"prompt": pid, "position": at, "expected": ref[at:at + 4], "got": out[at:at + 4],
                          "lengths": [len(out), len(ref)]})
    return found


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def load_prompts(path: str | None, num: int | None) -> tuple[list[str], list[str]]:
    """(prompts, names): a jsonl file with a "prompt" field, plain text lines, or the held-out set."""
    if path is None:
        from specserve.demo.corpus import load_heldout_prompts

        items = [(p["prompt"], p.get("id", str(i))) for i, p in enumerate(load_heldout_prompts())]
    else:
        items = []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and "prompt" in obj:
                items.append((obj["prompt"], str(obj.get("id", i))))
            else:
                items.append((line, str(i)))
    items = items[:num] if num else items
    if not items:
        raise ValueError(f"no prompts in {path or 'the held-out set'}")
    return [p for p, _ in items], [n for _, n in items]


def write_outputs(report: dict, json_path: str | None, plot_path: str | None, plot) -> None:
    """A benchmark's report as JSON at `json_path` and its plot at `plot_path` (each where given)."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(report, plot_path)
        print(f"plot: {plot_path}")
