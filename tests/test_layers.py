"""The packages' layering, read from the source's import statements (those inside functions too).

app/ (the engine) imports neither Ray nor the serving layers nor the tooling; specserve/demo/ builds on the
engine; deployments/ and cluster/ serve it; specserve/ (CLI, benchmarks, GPU check) sits on top. No
module imports, directly or through others, a module that imports it back.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "deployments", "cluster", "specserve")
# the layers, and what each may import of the others (and of Ray); everything else is off limits
ALLOWED = {
    "app": set(),
    "specserve.demo": {"app"},
    "deployments": {"app", "ray"},  # model paths only: the built pairs are filled in above it (specserve/serving.py)
    "cluster": {"app", "specserve.demo", "deployments", "ray"},
    "specserve": {"app", "specserve.demo", "deployments", "cluster", "ray"},
}


def layer(module: str) -> str:
    """The layer a module belongs to: the pair builder (specserve.demo) is below the rest of the tooling."""
    return "specserve.demo" if module == "specserve.demo" or module.startswith("specserve.demo.") else module.split(".")[0]


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
    assert {"app.engine", "deployments.servers", "specserve.cli", "specserve.demo.build", "cluster.local"} <= set(graph)
    assert "app.engine" in graph["deployments.servers"]  # a real import, found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_layers_below_it(graph, package):
    wrong = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if layer(mod) == package
                   for dep in deps if layer(dep) not in ALLOWED[package] | {package})
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


def test_the_tooling_keeps_its_top_level_short():
    """specserve/ holds the command and what it serves at its top level; the benchmarks (specserve/bench/),
    the GPU check (specserve/gpu/) and the pair builders (specserve/demo/) are packages of their own."""
    top = sorted(path.name for path in (ROOT / "specserve").glob("*.py"))
    assert len(top) <= 8, top


def test_no_source_file_outgrows_a_sitting():
    """A module a newcomer reads in one go: about 400 lines at most (split by concern past that)."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 420}
    assert not long, long


def test_the_wheel_installs_no_generic_top_level_package(tmp_path):
    """A user's own `tools` or `demo` module must never meet one of ours in site-packages: the built
    wheel holds only the design's top-level packages, the tooling under `specserve`."""
    import shutil
    import subprocess
    import sys
    import zipfile

    def unpackaged(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == ROOT
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info")
                or top and n in (".git", ".venv", "build", "tests", "docs", "k8s")}

    pytest.importorskip("setuptools")  # the build backend, from the venv (no network for an isolated build)
    src = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info beside its sources
    shutil.copytree(ROOT, src, ignore=unpackaged)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"app", "deployments", "cluster", "specserve"}, tops
    assert "specserve/cli.py" in names and "specserve/demo/smollm2.py" in names
    assert any(n.startswith("specserve/demo/weights/smollm2-draft/") for n in names)  # the shipped draft


MAX_PARAMETERS, MAX_LINES = 8, 60  # a function's parameters (self aside) and its lines
# Functions past those limits, with their (parameters, lines): none since issue 42. Were one ever let
# in, the test holds it to its size: a new entry, or an entry grown, fails; one back within must go.
OVER_LIMITS: dict[str, tuple[int, int]] = {}


def function_sizes() -> dict[str, tuple[int, int]]:
    """'path:Outer.function' -> (parameters without self/cls, lines) for every function in the packages,
    nested ones too."""
    out = {}

    def visit(node: ast.AST, path: Path, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.", True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [p for p in (a.vararg, a.kwarg) if p]
                n = len(params) - bool(in_class and params and params[0].arg in ("self", "cls"))
                out[f"{path.relative_to(ROOT)}:{prefix}{child.name}"] = (n, child.end_lineno - child.lineno + 1)
                visit(child, path, f"{prefix}{child.name}.", False)
            else:
                visit(child, path, prefix, in_class)

    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            visit(ast.parse(path.read_text(), str(path)), path, "", False)
    return out


def test_functions_keep_to_their_limits_and_the_known_excess_only_shrinks():
    sizes = function_sizes()
    over = {name: size for name, size in sizes.items() if size[0] > MAX_PARAMETERS or size[1] > MAX_LINES}
    new = sorted(set(over) - set(OVER_LIMITS))
    grown = sorted(name for name in set(over) & set(OVER_LIMITS)
                   if any(now > limit and now > known for now, known, limit in
                          zip(over[name], OVER_LIMITS[name], (MAX_PARAMETERS, MAX_LINES))))
    fixed = sorted(set(OVER_LIMITS) - set(over))
    assert not new, f"past {MAX_PARAMETERS} parameters or {MAX_LINES} lines: {[(n, over[n]) for n in new]}"
    assert not grown, f"grown past their recorded size: {[(n, over[n], OVER_LIMITS[n]) for n in grown]}"
    assert not fixed, f"within the limits now, drop them from OVER_LIMITS: {fixed}"


INGRESS_LINES = 200  # the Ingress class: HTTP routes, Serve glue, placement (issue 42)
# the OpenAI protocol's parts, which the front end (app/openai/front.py) puts together
FRONT_PARTS = {"app.openai.chat_template", "app.openai.tool_calls", "app.grammar", "app.openai.responses", "app.params", "app.job",
               "app.request"}


def test_the_ingress_keeps_to_routes_and_serve_glue(graph):
    """Request preparation and responses are the Ray-free front end's, testable in process
    (tests/test_front.py); the Serve class holds it, its routes, Serve glue and placement."""
    tree = ast.parse((ROOT / "deployments/ingress.py").read_text())
    (ingress,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Ingress"]
    lines = ingress.end_lineno - ingress.lineno + 1
    assert lines <= INGRESS_LINES, f"Ingress grew to {lines} lines"
    assert "app.openai.front" in graph["deployments.ingress"]
    assert not graph["deployments.ingress"] & FRONT_PARTS, graph["deployments.ingress"] & FRONT_PARTS


MODELING = ("transformers.modeling_utils", "transformers.masking_utils", "torch._dynamo")


@pytest.mark.parametrize("module, heavy", [
    ("deployments.ingress", ("app.model.runner",) + MODELING),
    ("deployments.application", MODELING),  # it names the servers' classes; their models load in the replicas
], ids=["ingress replica", "app build"])
def test_processes_that_load_no_model_import_no_modeling_code(module, heavy):
    """An ingress replica and the app's build (a process of its own at every deploy) load no model:
    importing them must not import transformers' modeling stack (its attention and mask registries
    included) or dynamo: seconds of CPU in every such process (the build's import: 13.6 -> 8.7 s on 2 cores)."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"
