"""`gpu_check --isolate SECONDS`: each step in a process of its own under a time limit.

A GPU is lent for minutes, and one step can outrun them: a compile that takes minutes, a batch that
never finishes. Run apart, a step past its limit is stopped and reported as such, the next one runs,
and the report is written after every step, so whatever ran is on disk however the run ends.
"""

import json
import subprocess
import sys
import time
from pathlib import Path


def run_isolated(steps: list[str], seconds: float, extra: list[str], json_path: str | None, tmp: Path,
                 say=print) -> dict:
    """Run `python -m specserve.gpu.check --only STEP` per step (with `extra` arguments), each stopped after
    `seconds`; its output goes straight to ours. Returns the merged report."""
    report: dict = {}
    for name in steps:
        out = tmp / f"{name}.json"
        started = time.perf_counter()
        try:
            code = subprocess.run([sys.executable, "-m", "specserve.gpu.check", "--only", name, "--json", str(out),
                                   *extra], timeout=seconds).returncode
        except subprocess.TimeoutExpired:  # the child is killed by now
            code = None
        if out.exists():
            child = json.loads(out.read_text())
            report.setdefault("device", child.get("device"))
            report[name] = child[name]
        else:
            why = (f"stopped after its {seconds:g} s (its last progress line is above)" if code is None
                   else f"exited with status {code} before writing its report")
            report[name] = {"ok": False, "error": why}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        if not report[name]["ok"]:
            say(f"gpu-check: {name}: FAILED ({report[name]['error']})", flush=True)
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=2))
    return report
