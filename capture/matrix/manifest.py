"""DIR/manifest.json: what ran, with what, where, and the sha256 of every file.

Written last by `tracekit run` (after the diffs), so the hashes cover the
traces, engine logs, checks and diff JSON. The report (DIR/report/) is
derived from those files and written later; it is not hashed here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path

from tracekit import __version__
from tracekit.runinfo import command_line, git_commit, host_info

SCHEMA = "tracekit.run-manifest/1"
NAME = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(root: Path, skip: tuple[str, ...] = (NAME, "report")) -> dict[str, str]:
    """relative path -> sha256 of every file under root, except the manifest and the report."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel.split("/")[0] not in skip:
            out[rel] = sha256_file(p)
    return out


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_manifest(
    root: str | Path,
    *,
    matrix: dict,
    engines: dict,
    cells: list[dict],
    started_utc: str,
    argv: list[str] | None = None,
    extra: dict | None = None,
) -> dict:
    """Write DIR/manifest.json and return it. `engines`: engine_id -> command, url, self-report, log."""
    root = Path(root)
    doc = {
        "schema": SCHEMA,
        "tool": f"tracekit {__version__}",
        "git_commit": git_commit(),
        "command": command_line(argv),
        "host": host_info(),
        "started_utc": started_utc,
        "finished_utc": now_utc(),
        "matrix": matrix,
        "engines": engines,
        "cells": cells,
        **(extra or {}),
        "files": file_hashes(root),
    }
    (root / NAME).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def read_manifest(root: str | Path) -> dict | None:
    p = Path(root) / NAME
    return json.loads(p.read_text()) if p.is_file() else None
