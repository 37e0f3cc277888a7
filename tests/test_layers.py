"""The packages' layering, read from the source's import statements (those inside functions too).

app/ (the engine) imports neither Ray nor the serving layers nor the tooling; demo/ builds on the
engine; deployments/ and cluster/ serve it; tools/ (CLI, benchmarks, GPU check) sits on top. No
module imports, directly or through others, a module that imports it back.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "demo", "deployments", "cluster", "tools")
# what each package may import of the others (and of Ray); everything else is off limits
ALLOWED = {
    "app": set(),
    "demo": {"app"},
    "deployments": {"app", "demo", "ray"},
    "cluster": {"app", "demo", "deployments", "ray"},
    "tools": {"app", "demo", "deployments", "cluster", "ray"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, name: str, known: set[str] = frozenset()) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports resolved). `from p import
    m` of a module m counts as importing p.m alone (Python runs p's __init__ for any of its modules)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    found = {name: imports(path, name, set(mods)) for name, path in mods.items()}
    return {name: {m for m in deps if (m in mods and m != name) or m.split(".")[0] == "ray"}
            for name, deps in found.items()}


def test_the_scan_sees_the_packages(graph):
    assert {"app.engine", "deployments.servers", "tools.cli", "demo.build", "cluster.local"} <= set(graph)
    assert "app.engine" in graph["deployments.servers"]  # a real import, found


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_layers_below_it(graph, package):
    wrong = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if mod.split(".")[0] == package
                   for dep in deps if dep.split(".")[0] not in ALLOWED[package] | {package})
    assert not wrong, wrong


def test_no_module_imports_itself_through_others(graph):
    internal = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(internal[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for start in sorted(internal):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles


def test_no_source_file_outgrows_a_sitting():
    """A module a newcomer reads in one go: about 400 lines at most (split by concern past that)."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 420}
    assert not long, long
