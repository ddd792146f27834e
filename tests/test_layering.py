"""The layering of docs/design.md, checked by walking the imports: `analyze`
never imports capture, aiohttp or torch; `capture` never imports analyze; the
core `tracekit` imports neither (except its CLI); h5py lives in tracekit/store/;
torch is imported lazily (inside functions) everywhere."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, top_level_only: bool = False):
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno


def _files(pkg):
    return sorted((ROOT / pkg).rglob("*.py"))


RULES = [
    ("analyze", {"capture", "aiohttp", "torch", "transformers", "h5py"}),
    ("capture", {"analyze", "h5py"}),
]


@pytest.mark.parametrize("pkg,forbidden", RULES)
def test_package_boundaries(pkg, forbidden):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _files(pkg)
        for mod, line in _imports(p)
        if mod in forbidden
    ]
    assert not bad, "\n".join(bad)


def test_core_does_not_import_capture_or_analyze():
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _files("tracekit")
        if "cli" not in p.relative_to(ROOT).parts
        for mod, line in _imports(p)
        if mod in {"capture", "analyze"}
    ]
    assert not bad, "\n".join(bad)


def test_h5py_only_in_the_store():
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for pkg in ("tracekit", "capture", "analyze")
        for p in _files(pkg)
        if "store" not in p.relative_to(ROOT).parts
        for mod, line in _imports(p)
        if mod == "h5py"
    ]
    assert not bad, "\n".join(bad)


MODEL_PACKAGES = ("tracekit/engine", "capture/teacher")  # modules that run a model may import torch at top level


def test_torch_is_imported_lazily():
    """A module-level `import torch` outside the model-running packages would make
    `tracekit diff` or `tracekit capture --http` pay for torch."""
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for pkg in ("tracekit", "capture", "analyze")
        for p in _files(pkg)
        if not str(p.relative_to(ROOT)).startswith(MODEL_PACKAGES)
        for mod, line in _imports(p, top_level_only=True)
        if mod in {"torch", "transformers"}
    ]
    assert not bad, "\n".join(bad)


def _loaded(modules: str, watch=("torch", "transformers", "aiohttp", "capture")) -> list:
    code = f"import sys, {modules}; print(sorted(m for m in {watch!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)


def test_diff_and_inspect_do_not_load_torch():
    assert _loaded("tracekit.cli.diff, tracekit.cli.show, tracekit.cli.inspect, analyze") == []


def test_http_capture_does_not_load_torch():
    assert _loaded("tracekit.cli.capture, capture.capture_run", watch=("torch", "transformers")) == []
