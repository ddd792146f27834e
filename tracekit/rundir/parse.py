"""JSON -> records, checked: the schema and version of each file, every field present and typed.

A newer version than this tracekit reads is a SchemaVersionError naming both
versions; an older one is read by its own function here and upgraded in
memory (version 1: `manifest_v1`, `cell_v1`); a missing or mistyped field is a
TraceFormatError naming the file and the field, never a guess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import SchemaVersionError, TraceFormatError
from .records import (
    DIFF_CLASSES,
    DIFF_SCHEMA,
    DIFF_VERSION,
    STATUSES,
    VERSION,
    Cell,
    CellRecord,
    Check,
    DiffRef,
    DiffSummary,
    EngineRecord,
    Manifest,
    PairEvidence,
    TeacherRef,
)


class Obj:
    """A JSON object being read: every field access names the file and the field on error."""

    def __init__(self, obj: Any, where: str):
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        self.obj, self.where = obj, where

    def get(self, name: str, typ, null: bool = False):
        if name not in self.obj:
            raise TraceFormatError(f"{self.where}: missing field {name!r}; the run directory is incomplete")
        v = self.obj[name]
        if v is None and null:
            return None
        ok = isinstance(v, typ) and not (isinstance(v, bool) and typ in (int, float, (int, float)))
        if not ok:
            want = getattr(typ, "__name__", "number")
            raise TraceFormatError(f"{self.where}: field {name!r} must be {want}, found {v!r:.60}")
        return v

    def sub(self, name: str, null: bool = False) -> "Obj | None":
        v = self.get(name, dict, null)
        return None if v is None else Obj(v, f"{self.where}:{name}")


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing; the run directory is incomplete") from None
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path}: not valid JSON ({e}); the file is corrupt") from None


def check_version(o: Obj, kind: str, newest: int = VERSION) -> int:
    """The version in `"schema": "<kind>/<n>"`; newer than this tracekit reads is an error."""
    s = o.get("schema", str)
    name, _, v = s.rpartition("/")
    if name != kind or not v.isdigit():
        raise TraceFormatError(f"{o.where}: schema {s!r} is not {kind}/<version>")
    if int(v) > newest:
        raise SchemaVersionError(
            f"{o.where}: {kind} version {v} is newer than this tracekit reads (version {newest}); "
            "upgrade tracekit (pip install -U tracekit)"
        )
    return int(v)


def write_json(path: Path, doc: dict) -> None:
    """Write JSON atomically (a killed run never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def parse_cell(o: Obj) -> Cell:
    c = Cell(
        o.get("target", str),
        o.get("dtype", str),
        o.get("prefix_cache", bool),
        o.get("prompts", str),
        o.get("output_tokens", int),
        o.get("concurrency", int),
    )
    for name in ("id", "engine_id", "group_id"):
        if o.get(name, str) != getattr(c, name):
            raise TraceFormatError(f"{o.where}: {name} {o.obj[name]!r} does not match the axes ({getattr(c, name)})")
    return c


def parse_checks(o: Obj) -> tuple[Check, ...]:
    out = []
    for i, c in enumerate(o.get("checks", list)):
        co = Obj(c, f"{o.where}:checks[{i}]")
        status = co.get("status", str)
        if status not in STATUSES:
            raise TraceFormatError(f"{co.where}: status {status!r}; expected one of {', '.join(STATUSES)}")
        out.append(Check(co.get("name", str), status, co.get("summary", str), co.get("evidence", dict)))
    return tuple(out)


def parse_teacher(o: Obj | None) -> TeacherRef | None:
    if o is None:
        return None
    keys = o.get("keys", list)
    return TeacherRef(
        o.get("trace", str), tuple(map(str, keys)), o.get("histories", str), o.get("dtypes", str), o.get("model", str)
    )


def parse_engine(o: Obj, engine_id: str) -> EngineRecord:
    cmd = o.get("command", list, null=True)
    return EngineRecord(
        engine_id,
        o.get("target", str),
        o.get("kind", str),
        o.get("log", str, null=True),
        None if cmd is None else tuple(map(str, cmd)),
        o.get("url", str, null=True),
        o.get("startup_s", (int, float), null=True),
        o.get("exit_code", int, null=True),
        o.get("self_report", dict),
        o.get("error", str, null=True),
    )


def parse_pair(o: Obj) -> PairEvidence:
    num, i = (int, float), int
    return PairEvidence(
        o.get("key", str),
        o.get("class", str),
        o.get("position", i, True),
        o.get("token_a", i, True),
        o.get("token_b", i, True),
        o.get("gap_a", num, True),
        o.get("gap_b", num, True),
        o.get("gap_a_ulp", num, True),
        o.get("gap_b_ulp", num, True),
        o.get("boundary_a", i, True),
        o.get("boundary_b", i, True),
        o.get("drift_max", num, True),
        o.get("rule", str),
        o.get("teacher", str, True),
    )


def read_diff(path: Path) -> DiffSummary:
    """A diff.json (tracekit.diff/1 or /2) -> DiffSummary; TraceFormatError naming the file otherwise."""
    o = Obj(load(path), str(path))
    v = check_version(o, DIFF_SCHEMA, DIFF_VERSION)
    s = o.sub("summary")
    counts = {k: s.get(k, int) for k in ("pairs", *DIFF_CLASSES)}
    pairs = tuple(parse_pair(Obj(p, f"{path}:pairs[{j}]")) for j, p in enumerate(o.get("pairs", list)))
    filtered = v >= 2 and o.get("only", list, null=True) is not None  # `diff --only` lists a subset
    if not filtered and len(pairs) != counts["pairs"]:
        raise TraceFormatError(f"{path}: summary says {counts['pairs']} pairs, the file lists {len(pairs)}")
    th = o.get("thresholds", dict)
    return DiffSummary(o.get("a", str), o.get("b", str), counts, th, pairs, tuple(map(str, o.get("notes", list))))


def _manifest_common(o: Obj, cells: tuple[str, ...], engines: tuple[EngineRecord, ...], v: int) -> Manifest:
    mx = o.sub("matrix")
    files = o.get("files", dict)
    return Manifest(
        o.get("tool", str),
        o.get("git_commit", str, True),
        o.get("command", str),
        o.get("host", dict),
        o.get("started_utc", str),
        o.get("finished_utc", str),
        mx.get("name", str),
        mx.get("path", str),
        cells,
        engines,
        {str(k): str(h) for k, h in files.items()},
        v,
        # Added to version 2 with shards: absent in a file written before means "not recorded" /
        # "not a shard" / "not merged", the only thing such a file can mean.
        mx.obj.get("sha256") if isinstance(mx.obj.get("sha256"), str) else None,
        o.get("shard", dict, null=True) if "shard" in o.obj else None,
        o.get("merged", dict, null=True) if "merged" in o.obj else None,
    )


def manifest_v2(o: Obj) -> Manifest:
    eng = o.sub("engines")
    engines = tuple(parse_engine(Obj(e, f"{eng.where}:{k}"), k) for k, e in eng.obj.items())
    return _manifest_common(o, tuple(map(str, o.get("cells", list))), engines, 2)


def manifest_v1(o: Obj) -> Manifest:
    """Version 1 kept each cell's axes, checks_ok and diff_error in `cells` (a list of objects),
    engines without their id field, and the demo's teacher-forced keys in `teacher_forced`."""
    eng = o.sub("engines")
    engines = tuple(parse_engine_v1(Obj(e, f"{eng.where}:{k}"), k) for k, e in eng.obj.items())
    cells = tuple(Obj(c, f"{o.where}:cells[{i}]").get("id", str) for i, c in enumerate(o.get("cells", list)))
    return _manifest_common(o, cells, engines, 1)


def parse_engine_v1(o: Obj, engine_id: str) -> EngineRecord:
    """Version 1 wrote only the engine fields that applied: no url, startup or self-report for an
    engine that did not start, no error for one that did. Absent there means None."""
    full = {k: None for k in ("log", "command", "url", "startup_s", "exit_code", "error")}
    return parse_engine(Obj({**full, "self_report": {}, **o.obj}, o.where), engine_id)


MANIFEST_READERS = {1: manifest_v1, 2: manifest_v2}


def _checks_file(root: Path, o: Obj, newest: int) -> tuple[Check, ...]:
    cp = root / o.get("checks", str)
    co = Obj(load(cp), str(cp))
    check_version(co, "tracekit.checks", newest)
    return parse_checks(co)


def cell_v2(root: Path, cell_id: str, o: Obj) -> CellRecord:
    """cells/<id>/cell.json (tracekit.cell/2) and the checks.json it names."""
    check_version(o, "tracekit.cell")
    cell = parse_cell(o.sub("cell"))
    if cell.id != cell_id:
        raise TraceFormatError(f"{o.where}: holds cell {cell.id!r}, not {cell_id!r}")
    d = o.sub("diff")
    diff = DiffRef(d.get("path", str, True), d.get("error", str, True))
    if (diff.path is None) == (diff.error is None):
        raise TraceFormatError(f"{d.where}: exactly one of 'path' and 'error' must be set")
    return CellRecord(
        cell,
        o.get("baseline", str, True),
        o.get("burst", str, True),
        _checks_file(root, o, VERSION),
        diff,
        parse_teacher(o.sub("teacher", null=True)),
    )


def cell_v1(root: Path, man: Obj | None, cell_id: str, o: Obj) -> CellRecord:
    """Upgrade a version-1 cell. Version 1 wrote cell.json without a schema and kept the diff's
    error (null when diff.json was written) and the teacher-forced step in the manifest, so a
    version-1 cell is read only with its version-1 manifest."""
    if man is None or check_version(man, "tracekit.run-manifest") != 1:
        raise TraceFormatError(f"{o.where}: missing field 'schema'; the run directory is incomplete or corrupt")
    entry = next((c for c in man.get("cells", list) if isinstance(c, dict) and c.get("id") == cell_id), None)
    if entry is None:
        raise TraceFormatError(f"{man.where}: no entry for cell {cell_id!r}")
    err = Obj(entry, f"{man.where}:cells[{cell_id}]").get("diff_error", str, True)
    diff = DiffRef(None, err) if err else DiffRef(o.get("diff", str), None)
    teacher = (man.obj.get("teacher_forced") or {}).get(cell_id)
    return CellRecord(
        parse_cell(o),
        o.get("baseline", str, True),
        o.get("burst", str, True),
        _checks_file(root, o, 1),
        diff,
        None if teacher is None else parse_teacher(Obj(teacher, f"{man.where}:teacher_forced:{cell_id}")),
    )
