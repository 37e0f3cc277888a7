"""The image copies every local package the served app and the CLI import (k8s/Dockerfile): a
`specserve demo-models` in the DEMO image once failed for want of `specserve/demo/` and `specserve/`."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("specserve/cli.py", "specserve/serving.py")  # the console script, the shipped configs' Serve import_path


def local_packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py")}


def imported_locals(start: list[Path], local: set[str]) -> set[str]:
    """Local top-level packages reachable by imports (at any depth, lazy ones inside functions too)."""
    seen, todo, found = set(), list(start), {p.relative_to(ROOT).parts[0] for p in start}
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in local:
                    found.add(top)
                    todo.extend((ROOT / top).rglob("*.py"))
    return found


def test_the_image_copies_every_local_package_the_entry_points_reach():
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+\1\s*$", (ROOT / "k8s/Dockerfile").read_text(), re.M))
    reached = imported_locals([ROOT / p for p in ENTRY_POINTS], local_packages())
    assert {"app", "deployments", "specserve"} <= reached  # the walk sees lazy imports too
    assert reached <= copied, f"imported but not copied into the image: {sorted(reached - copied)}"
    # and the shipped draft's weights go with specserve/demo/ (package data, pyproject.toml)
    assert '"specserve.demo" = ["weights/smollm2-draft/*"]' in (ROOT / "pyproject.toml").read_text()
