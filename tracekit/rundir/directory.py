"""`RunDir`: the layout of a run directory, and the only code that writes or reads its JSON."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import ConfigError, SchemaVersionError, TraceFormatError, UsageError
from ..files import sha256_file
from .parse import (
    MANIFEST_READERS,
    Obj,
    cell_v1,
    cell_v2,
    check_version,
    load,
    parse_engine,
    read_diff,
    write_json,
)
from .records import (
    EXPLAIN_JSON,
    EXPLAIN_SCHEMA,
    MANIFEST,
    MATRIX_COPY,
    REPORT,
    VERSION,
    CellRecord,
    DiffRef,
    EngineRecord,
    LoadedCell,
    Manifest,
    RunView,
)
from .shards import SHARD_JSON, ShardInfo


def write_explain(directory: str | os.PathLike, doc: dict) -> Path:
    """Store a tracekit.explain document as DIRECTORY/explain.json (a cell's explain/ or a pair's --out)."""
    path = Path(directory) / EXPLAIN_JSON
    write_json(path, doc)
    return path


def read_explain(directory: str | os.PathLike) -> tuple[dict | None, str | None]:
    """The tracekit.explain document of DIRECTORY/explain.json: (doc, None), (None, None) when
    there is none, (None, reason) when it is unreadable or not such a document."""
    path = Path(directory) / EXPLAIN_JSON
    if not path.is_file():
        return None, None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path}: unreadable ({e})"
    if not isinstance(doc, dict) or doc.get("schema") != EXPLAIN_SCHEMA or not isinstance(doc.get("pairs"), list):
        return None, f"{path}: not a {EXPLAIN_SCHEMA} document"
    return doc, None


class RunDir:
    """One run directory. Paths in records are relative to it, so a run can move."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._manifest_doc: Obj | None | bool = False  # False: not read yet

    # layout (relative paths)
    @staticmethod
    def serial_rel(group_id: str) -> str:
        return f"groups/{group_id}/serial.h5"

    @staticmethod
    def burst_rel(cell_id: str) -> str:
        return f"cells/{cell_id}/burst.h5"

    @staticmethod
    def repeat_rel(group_id: str, concurrency: int, r: int) -> str:
        """A calibration repeat: the group's burst at this concurrency once more (healthy targets only)."""
        return f"groups/{group_id}/repeat-c{concurrency}-{r}.h5"

    @staticmethod
    def cold_rel(group_id: str) -> str:
        """The cold reference: the group's prompts serially, the prefix cache reset before each request."""
        return f"groups/{group_id}/cold.h5"

    @staticmethod
    def cold_diff_rel(cell_id: str) -> str:
        """The cell's burst judged against the cold reference (a tracekit.diff document)."""
        return f"cells/{cell_id}/diff-cold.json"

    @staticmethod
    def calibration_rel(engine_id: str) -> str:
        """The tracekit.calibration record measured on this engine configuration's repeats."""
        return f"calibration/{engine_id}.json"

    @staticmethod
    def diff_rel(cell_id: str) -> str:
        return f"cells/{cell_id}/diff.json"

    @staticmethod
    def teacher_rel(cell_id: str) -> str:
        return f"cells/{cell_id}/teacher.h5"

    @staticmethod
    def engine_log_rel(engine_id: str) -> str:
        return f"engines/{engine_id}.log"

    @staticmethod
    def explain_rel(cell_id: str) -> str:
        """Where `tracekit explain RUN_DIR` (and the demo) keep a cell's explain traces and explain.json."""
        return f"cells/{cell_id}/explain"

    def path(self, rel: str) -> Path:
        return self.root / rel

    def explain_dir(self, cell_id: str) -> Path:
        return self.root / self.explain_rel(cell_id)

    def read_explain(self, cell_id: str) -> tuple[dict | None, str | None]:
        """(the cell's tracekit.explain document, None); (None, None) when the cell was not
        explained; (None, why) when its explain.json cannot be read."""
        return read_explain(self.explain_dir(cell_id))

    @property
    def report_dir(self) -> Path:
        return self.root / REPORT

    # writing
    @classmethod
    def create(cls, root: str | os.PathLike, matrix_text: str) -> "RunDir":
        """A new run directory holding the matrix as read; an existing run is never overwritten."""
        rd = cls(root)
        if (rd.root / "cells").exists() or (rd.root / MANIFEST).exists():
            raise ConfigError(f"{rd.root}: already holds a run; choose another --out (runs are never overwritten)")
        rd.root.mkdir(parents=True, exist_ok=True)
        (rd.root / MATRIX_COPY).write_text(matrix_text, encoding="utf-8")
        return rd

    @classmethod
    def reopen(cls, root: str | os.PathLike, matrix_text: str) -> "RunDir":
        """An unfinished (or finished) run of the same matrix, to resume (`tracekit run --resume`).
        Its manifest is removed until the resumed run writes a new one, so a resume killed in turn
        never leaves a manifest that claims the run is complete."""
        rd = cls(root)
        copy = rd.root / MATRIX_COPY
        if not copy.is_file():
            raise UsageError(f"{rd.root}: no run to resume (no {MATRIX_COPY}); run without --resume")
        if copy.read_text(encoding="utf-8") != matrix_text:
            raise UsageError(
                f"{rd.root}: holds a run of another matrix (its {MATRIX_COPY} differs from the file given); "
                "resume with the matrix it ran, or choose another --out"
            )
        (rd.root / MANIFEST).unlink(missing_ok=True)
        rd._manifest_doc = False
        return rd

    def write_shard(self, info: ShardInfo) -> None:
        write_json(self.root / SHARD_JSON, info.to_json())

    def read_shard(self) -> ShardInfo | None:
        """shard.json (which shard of which matrix), or None for a run of a whole matrix."""
        p = self.root / SHARD_JSON
        return ShardInfo.from_json(load(p), str(p)) if p.is_file() else None

    def finished_cells(self) -> set[str]:
        """Cells whose cell.json reads and whose diff step ran (a diff, or the reason for none):
        what `--resume` keeps."""
        done = set()
        if not (self.root / "cells").is_dir():
            return done
        for p in (self.root / "cells").iterdir():
            try:
                r = self.read_cell(p.name)
            except TraceFormatError:
                continue
            if r.diff.error is None or not r.diff.error.startswith("not computed"):
                done.add(p.name)
        return done

    def discard(self, group_id: str, cell_ids) -> None:
        """Remove what an unfinished group left (its serial baseline, its cells) before it reruns."""
        for rel in [f"groups/{group_id}", *(f"cells/{c}" for c in cell_ids)]:
            shutil.rmtree(self.root / rel, ignore_errors=True)

    def read_engines(self) -> list[EngineRecord]:
        """Every engines/<id>.json, in name order (a resumed run's earlier engines included)."""
        out = []
        for p in sorted((self.root / "engines").glob("*.json")):
            o = Obj(load(p), str(p))
            check_version(o, "tracekit.engine")
            out.append(parse_engine(o, p.stem))
        return out

    def write_engine(self, e: EngineRecord) -> None:
        write_json(
            self.root / "engines" / f"{e.engine_id}.json", {"schema": f"tracekit.engine/{VERSION}", **e.to_json()}
        )

    def write_cell(self, r: CellRecord) -> None:
        cid = r.cell.id
        write_json(
            self.root / "cells" / cid / "checks.json",
            {"schema": f"tracekit.checks/{VERSION}", "cell": cid, "checks": [c.to_json() for c in r.checks]},
        )
        write_json(
            self.root / "cells" / cid / "cell.json",
            {
                "schema": f"tracekit.cell/{VERSION}",
                "cell": r.cell.to_json(),
                "baseline": r.baseline,
                "burst": r.burst,
                "checks": f"cells/{cid}/checks.json",
                "diff": r.diff.to_json(),
                "teacher": None if r.teacher is None else r.teacher.to_json(),
            },
        )

    def write_diff(self, cell_id: str, doc: dict, a: str, b: str, cold: bool = False) -> DiffRef:
        """Store a tracekit.diff document (its trace paths made relative to DIR): the cell's diff.json,
        or with `cold` its diff against the cold reference (diff-cold.json)."""
        rel = self.cold_diff_rel(cell_id) if cold else self.diff_rel(cell_id)
        write_json(self.root / rel, {**doc, "a": a, "b": b})
        return DiffRef(rel, None)

    def file_hashes(self) -> dict[str, str]:
        """relative path -> sha256 of every file under DIR, except the manifest and report/."""
        out = {}
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and rel != MANIFEST and rel.split("/")[0] != REPORT:
                out[rel] = sha256_file(p)
        return out

    def write_manifest(self, m: Manifest) -> None:
        write_json(
            self.root / MANIFEST,
            {
                "schema": f"tracekit.run-manifest/{VERSION}",
                "tool": m.tool,
                "git_commit": m.git_commit,
                "command": m.command,
                "host": dict(m.host),
                "started_utc": m.started_utc,
                "finished_utc": m.finished_utc,
                "matrix": {
                    "name": m.matrix_name,
                    "path": m.matrix_path,
                    "copy": MATRIX_COPY,
                    "sha256": m.matrix_sha256,
                },
                "shard": None if m.shard is None else dict(m.shard),
                "merged": None if m.merged is None else dict(m.merged),
                "engines": {e.engine_id: e.to_json() for e in m.engines},
                "cells": list(m.cells),
                "files": dict(m.files),
            },
        )
        self._manifest_doc = False

    # reading
    def _raw_manifest(self) -> Obj | None:
        if self._manifest_doc is False:
            p = self.root / MANIFEST
            self._manifest_doc = Obj(load(p), str(p)) if p.is_file() else None
        return self._manifest_doc

    def read_manifest(self) -> Manifest | None:
        """The manifest, or None when there is none (a run still going, or killed before the end)."""
        o = self._raw_manifest()
        if o is None:
            return None
        v = check_version(o, "tracekit.run-manifest")
        if v not in MANIFEST_READERS:
            raise SchemaVersionError(f"{o.where}: unknown version {v} (this tracekit reads {sorted(MANIFEST_READERS)})")
        return MANIFEST_READERS[v](o)

    def cell_ids(self) -> list[str]:
        """Cell ids in run order (the manifest's), else in directory order."""
        if not (self.root / "cells").is_dir():
            raise ConfigError(
                f"{self.root}: not a `tracekit run` directory (no cells/); run `tracekit run MATRIX --out DIR`"
            )
        m = self.read_manifest()
        return list(m.cells) if m is not None else sorted(p.name for p in (self.root / "cells").iterdir())

    def read_cell(self, cell_id: str) -> CellRecord:
        p = self.root / "cells" / cell_id / "cell.json"
        o = Obj(load(p), str(p))
        if "schema" not in o.obj:  # version 1 wrote cell.json without a schema
            return cell_v1(self.root, self._raw_manifest(), cell_id, o)
        return cell_v2(self.root, cell_id, o)

    def load_cell(self, cell_id: str) -> LoadedCell:
        """The cell and its diff; a diff that cannot be read is the cell's diff_error."""
        r = self.read_cell(cell_id)
        if r.diff.path is None:
            return LoadedCell(r, None, r.diff.error)
        try:
            return LoadedCell(r, read_diff(self.root / r.diff.path), None)
        except TraceFormatError as e:
            return LoadedCell(r, None, f"diff unreadable: {e}")

    def load(self) -> tuple[Manifest | None, list[LoadedCell]]:
        """The manifest (None without one) and every cell, in run order; any file that cannot be
        read is an error (TraceFormatError), except a diff (kept on its cell)."""
        v = self.view()
        if v.unreadable:
            raise TraceFormatError(v.unreadable[0][1])
        return v.manifest, list(v.cells)

    def view(self) -> RunView:
        """As load(), for a report: a cell whose cell.json or checks.json cannot be read is listed
        in `unreadable` with the reason and the others are still read; a file of a newer version
        still stops the read (SchemaVersionError)."""
        cells, unreadable = [], []
        for cid in self.cell_ids():
            try:
                cells.append(self.load_cell(cid))
            except SchemaVersionError:
                raise
            except TraceFormatError as e:
                unreadable.append((cid, str(e)))
        if not cells and not unreadable:
            raise ConfigError(f"{self.root}: the run has no cells")
        return RunView(self.read_manifest(), tuple(cells), tuple(unreadable))
