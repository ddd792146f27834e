"""Helpers shared by the test files (importable as `support`: pyproject's pytest `pythonpath`).

replay (the transcript-replaying server), capture_helpers, dialect_fields_shared,
analyze_builders, redteam_builders, explain_builders, engine_helpers, fuzz_reader and
writer_child (both also run as subprocesses). `load_file` imports a script that is no
package module (scripts/llamacpp.py, bench/crash.py, fixtures/format/make_reference.py)
by its path; `subprocess_env` lets a child process import `support` too."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def load_file(relpath: str, name: str) -> ModuleType:
    """The module at ROOT/relpath, imported once as `name`."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before exec: dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ with tests/ and the checkout first on PYTHONPATH (plus `extra`)."""
    path = [str(TESTS), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(path)}
