"""The demo corpus: the Python standard library's own source, minus a few held-out modules.

Every machine with Python has it, so the demo pair builds anywhere without a download. The
held-out modules never reach the tokenizer or the models; the benchmark's prompts come from them
(`heldout_prompts`), so measured acceptance is on text neither model has seen.
"""

from __future__ import annotations

import ast
import inspect
import json
import sysconfig
from pathlib import Path

# Top-level stdlib modules kept out of training; present in every CPython since 3.9.
HELDOUT_MODULES = (
    "calendar", "difflib", "fractions", "graphlib", "shlex", "statistics", "tabnanny", "textwrap",
)
# Tests, vendored packages and generated codec tables are not the code we want to imitate.
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "__pycache__"}

PROMPTS_PATH = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"


def stdlib_dir() -> Path:
    """The directory of this interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(rel: Path) -> bool:
    return len(rel.parts) == 1 and rel.stem in HELDOUT_MODULES


def training_files(root: Path | None = None) -> list[Path]:
    """Every stdlib .py file the models may train on, sorted so the build is reproducible."""
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.isdisjoint(rel.parts[:-1]) and not _is_heldout(rel):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> str:
    """A source file's text; undecodable bytes (a few legacy files) are replaced."""
    return path.read_text(encoding="utf-8", errors="replace")


def training_texts(root: Path | None = None) -> list[str]:
    """The training documents: one string per training file, in `training_files` order."""
    return [read_source(p) for p in training_files(root)]


def heldout_files(root: Path | None = None) -> list[Path]:
    """The held-out modules' files that exist in this stdlib."""
    root = root or stdlib_dir()
    return [root / f"{m}.py" for m in HELDOUT_MODULES if (root / f"{m}.py").exists()]


# --- prompts ------------------------------------------------------------------------------

def _code_prompt(source: str, fn: ast.FunctionDef, max_chars: int = 400) -> str | None:
    """The head of a function (signature, docstring start, first lines), cut at a line end."""
    lines = source.splitlines(keepends=True)[fn.lineno - 1 : fn.end_lineno]
    if sum(map(len, lines)) < 2 * max_chars:  # too short to leave something to continue
        return None
    head = ""
    for line in lines:
        if len(head) + len(line) > max_chars:
            break
        head += line
    return head if head.count("\n") >= 3 else None


def _prose_prompt(doc: str, max_chars: int = 240) -> str | None:
    """The start of a docstring, cut at a word boundary, with something left to continue."""
    text = inspect.cleandoc(doc)
    if len(text) < 2 * max_chars:
        return None
    cut = text.rfind(" ", 0, max_chars)
    return text[:cut]


def _module_prompts(path: Path, n_code: int, n_prose: int) -> list[dict]:
    source = read_source(path)
    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda n: n.lineno)
    codes = [p for n in nodes if isinstance(n, ast.FunctionDef) if (p := _code_prompt(source, n))]
    docs = [ast.get_docstring(n, clean=False) for n in [tree, *nodes]]
    proses = [p for d in docs if d and (p := _prose_prompt(d))]
    return [{"kind": "code", "prompt": p} for p in codes[:n_code]] + [
        {"kind": "prose", "prompt": p} for p in proses[:n_prose]
    ]


def heldout_prompts(n_code: int = 2, n_prose: int = 1, root: Path | None = None) -> list[dict]:
    """Prompts from the held-out modules: `n_code` function heads and `n_prose` docstrings each.

    A candidate that occurs verbatim anywhere in the training text (copied code) is skipped.
    """
    training = "\n".join(training_texts(root))
    prompts = []
    for path in heldout_files(root):
        for p in _module_prompts(path, n_code + 2, n_prose + 2):
            kind_count = sum(q["kind"] == p["kind"] and q["module"] == path.stem for q in prompts)
            if kind_count < (n_code if p["kind"] == "code" else n_prose) and p["prompt"] not in training:
                idx = f"{path.stem}-{p['kind']}-{kind_count}"
                prompts.append({"id": idx, "kind": p["kind"], "module": path.stem, "prompt": p["prompt"]})
    return prompts


def write_heldout_prompts(path: Path = PROMPTS_PATH) -> Path:
    """Regenerate the committed held-out prompt set (one JSON object per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": p["id"], "kind": p["kind"], "prompt": p["prompt"]} for p in heldout_prompts()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def load_heldout_prompts(path: Path = PROMPTS_PATH) -> list[dict]:
    """The committed held-out prompts: dicts with id, kind ("code" | "prose") and prompt."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
