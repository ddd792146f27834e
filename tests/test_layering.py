"""The floors of docs/design.md, checked by walking the imports of every file.

    cli        (cli/,       tracekit.cli)        the thin command line
    workflows  (workflows/, tracekit.workflows)  orchestration that needs capture and analyze
    capture    (capture/,   tracekit.capture)    |  analyze (analyze/, tracekit.analyze)
    core       (tracekit/,  tracekit)            schema, store, errors, dtypes, run metadata, engine

No file imports a floor above its own (imports inside functions count too), capture and
analyze never import each other, no files form a circle, h5py lives in tracekit/store/,
torch is imported lazily outside the model-running packages, and nothing generic is
importable at the top level (`import capture` must fail for an installed tracekit)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> installed package name (pyproject's package-dir)
FOLDERS = {
    "tracekit": "tracekit",
    "capture": "tracekit.capture",
    "analyze": "tracekit.analyze",
    "workflows": "tracekit.workflows",
    "cli": "tracekit.cli",
}
FLOOR = {"tracekit": 0, "capture": 1, "analyze": 1, "workflows": 2, "cli": 3}


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files(folder: str | None = None) -> list[Path]:
    folders = [folder] if folder else list(FOLDERS)
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path, top_level_only: bool = False):
    """(absolute module name, line) for each import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for a in node.names:  # `from pkg import submodule`
                yield f"{mod}.{a.name}", node.lineno


def _folder_of_module(mod: str) -> str | None:
    best = None
    for folder, pkg in FOLDERS.items():
        if mod == pkg or mod.startswith(pkg + "."):
            if best is None or len(pkg) > len(FOLDERS[best]):
                best = folder
    return best


def test_no_import_runs_back_up():
    """An arrow from a lower floor to a higher one (or between capture and analyze) is a
    layering inversion: the core would need the CLI, capture would need the classifier."""
    bad = []
    for folder in FOLDERS:
        for p in _files(folder):
            for mod, line in _imports(p):
                target = _folder_of_module(mod)
                if target is None or target == folder:
                    continue
                if FLOOR[target] > FLOOR[folder] or (FLOOR[target] == FLOOR[folder]):
                    bad.append(f"{p.relative_to(ROOT)}:{line} imports {mod} ({folder} -> {target})")
    assert not bad, "\n".join(bad)


def test_core_does_not_import_capture_or_analyze():
    """The bottom floor alone: the trace format, the store and the engine must be usable
    (and testable) without the capture client or the classifier."""
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _files("tracekit")
        for mod, line in _imports(p)
        if _folder_of_module(mod) not in (None, "tracekit")
    ]
    assert not bad, "\n".join(bad)


def _module_files() -> dict[str, Path]:
    return {_module_of(p): p for p in _files()}


# Being taken apart (the teacher's TP wiring, the engine's fault hooks); this list only shrinks.
KNOWN_CIRCLES = []


def test_no_files_form_a_circle():
    """A circle of files (hidden or not by imports inside functions) means no file of it can be
    read, tested or moved alone."""
    files = _module_files()
    graph = {m: set() for m in files}
    for m, p in files.items():
        for mod, _ in _imports(p):
            while mod and mod not in files:
                mod = mod.rpartition(".")[0]
            if mod and mod != m and not files[mod].name == "__init__.py":
                graph[m].add(mod)
    # Tarjan's strongly connected components
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    out = [c for c in out if c not in KNOWN_CIRCLES]
    assert not out, "\n".join(" <-> ".join(c) for c in out)


RULES = [
    ("analyze", {"aiohttp", "torch", "transformers", "h5py"}),
    ("capture", {"h5py"}),
]


@pytest.mark.parametrize("folder,forbidden", RULES)
def test_package_boundaries(folder, forbidden):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _files(folder)
        for mod, line in _imports(p)
        if mod.split(".")[0] in forbidden
    ]
    assert not bad, "\n".join(bad)


def test_h5py_only_in_the_store():
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _files()
        if "store" not in p.relative_to(ROOT).parts
        for mod, line in _imports(p)
        if mod.split(".")[0] == "h5py"
    ]
    assert not bad, "\n".join(bad)


MODEL_PACKAGES = ("tracekit/engine", "capture/teacher")  # modules that run a model may import torch at top level


def test_torch_is_imported_lazily():
    """A module-level `import torch` outside the model-running packages would make
    `tracekit diff` or `tracekit capture --http` pay for torch."""
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _files()
        if not str(p.relative_to(ROOT)).startswith(MODEL_PACKAGES)
        for mod, line in _imports(p, top_level_only=True)
        if mod.split(".")[0] in {"torch", "transformers"}
    ]
    assert not bad, "\n".join(bad)


def _loaded(modules: str, watch=("torch", "transformers", "aiohttp", "tracekit.capture")) -> list:
    code = f"import sys, {modules}; print(sorted(m for m in {watch!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)


def test_diff_and_inspect_do_not_load_torch():
    assert _loaded("tracekit.cli.diff, tracekit.cli.show, tracekit.cli.inspect, tracekit.analyze") == []


def test_http_capture_does_not_load_torch():
    assert _loaded("tracekit.cli.capture, tracekit.capture.http", watch=("torch", "transformers")) == []
