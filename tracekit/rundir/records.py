"""The records of a run directory and the constants of its format (tracekit/rundir/__init__.py)."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..schema import redact
from ..verdicts import FAILING as _FAILING
from ..verdicts import NAMES

VERSION = 2  # of the whole directory: every JSON file of a run carries the same version
MANIFEST = "manifest.json"
MATRIX_COPY = "matrix.toml"
EXPLAIN_JSON = "explain.json"  # in cells/<id>/explain/ (or a pair's explain --out directory)
EXPLAIN_SCHEMA = "tracekit.explain/1"
REPORT = "report"  # derived from the rest, rewritten by `tracekit report`; never hashed
STATUSES = ("pass", "fail", "skip")
DIFF_SCHEMA = "tracekit.diff"  # written by analyze (DiffResult.to_json); read here for the report
DIFF_VERSION = 2  # versions 1 and 2 hold every field read here (the summary and PairEvidence's)
# tracekit.diff "summary": the pair count and one count per class (analyze/classify.py CLASSES).
DIFF_CLASSES = NAMES  # the verdict vocabulary (tracekit/verdicts.py)
FAILING = tuple(v.value for v in _FAILING)


@dataclass(frozen=True)
class Cell:
    """One cell of a matrix: the axes that name it."""

    target: str
    dtype: str
    prefix_cache: bool
    prompts: str
    output_tokens: int
    concurrency: int

    @property
    def engine_id(self) -> str:
        """The engine configuration: one engine process serves every cell with this id."""
        return f"{self.target}.{self.dtype}.cache-{'on' if self.prefix_cache else 'off'}"

    @property
    def group_id(self) -> str:
        """Cells sharing a serial baseline (they differ only in concurrency)."""
        return f"{self.engine_id}.{self.prompts}.out{self.output_tokens}"

    @property
    def id(self) -> str:
        return f"{self.group_id}.c{self.concurrency}"

    def label(self) -> str:
        """What a reader needs to know about the cell in one phrase."""
        return (
            f"{self.target} {self.dtype.upper()} cache-{'on' if self.prefix_cache else 'off'} "
            f"{self.prompts} out{self.output_tokens} c{self.concurrency}"
        )

    def to_json(self) -> dict:
        return {"id": self.id, "engine_id": self.engine_id, "group_id": self.group_id, **_fields(self)}


@dataclass(frozen=True)
class Check:
    """One lifecycle check of a cell: pass / fail / skip, a one-line summary with the numbers
    that decided it, and the evidence (JSON-able)."""

    name: str
    status: str  # "pass" | "fail" | "skip"
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, "evidence": self.evidence}


@dataclass(frozen=True)
class DiffRef:
    """Where a cell's diff is, or why it has none. Exactly one of the two is set."""

    path: str | None  # relative to DIR: cells/<id>/diff.json
    error: str | None  # "a capture failed", "diff failed: ...", "not computed: ..."

    def to_json(self) -> dict:
        return {"path": self.path, "error": self.error}


NOT_DIFFED = DiffRef(None, "not computed: the run stopped before the diff step")


@dataclass(frozen=True)
class TeacherRef:
    """The teacher-forced diagnostic of a cell's divergent keys (`tracekit demo`)."""

    trace: str  # relative to DIR
    keys: tuple[str, ...]
    histories: str
    dtypes: str
    model: str

    def to_json(self) -> dict:
        return {**_fields(self), "keys": list(self.keys)}


@dataclass(frozen=True)
class CellRecord:
    """What the runner knows of a cell: cells/<id>/cell.json + checks.json.
    A = the serial baseline (concurrency 1), B = the concurrent burst; both on the cell's engine."""

    cell: Cell
    baseline: str | None  # relative to DIR; None when the capture did not run
    burst: str | None
    checks: tuple[Check, ...]
    diff: DiffRef = NOT_DIFFED
    teacher: TeacherRef | None = None

    @property
    def failed_checks(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    @property
    def checks_ok(self) -> bool:
        return not self.failed_checks


@dataclass(frozen=True)
class PairEvidence:
    """One pair of a diff.json (tracekit.diff/1) as the report shows it. None = unknown."""

    key: str
    cls: str
    position: int | None
    token_a: int | None
    token_b: int | None
    gap_a: float | None  # nats
    gap_b: float | None
    gap_a_ulp: float | None  # steps of the run's grid
    gap_b_ulp: float | None
    boundary_a: int | None  # cached_tokens
    boundary_b: int | None
    drift_max: float | None  # max |Δ chosen logprob| before the divergence, nats
    rule: str
    teacher: str | None


@dataclass(frozen=True)
class DiffSummary:
    """A cell's diff.json read back: counts per class, thresholds, every pair's evidence."""

    a: str
    b: str
    counts: Mapping[str, int]  # "pairs" and each of DIFF_CLASSES
    thresholds: Mapping[str, float]
    pairs: tuple[PairEvidence, ...]
    notes: tuple[str, ...] = ()

    @property
    def n_pairs(self) -> int:
        return self.counts["pairs"]

    @property
    def identical(self) -> int:
        return self.counts["identical"]

    @property
    def failing(self) -> int:
        return sum(self.counts[k] for k in FAILING)


@dataclass(frozen=True)
class LoadedCell:
    """A cell as the report reads it: its record, and its diff or the reason it has none."""

    record: CellRecord
    diff: DiffSummary | None
    diff_error: str | None  # set exactly when diff is None

    @property
    def cell(self) -> Cell:
        return self.record.cell

    @property
    def passed(self) -> bool:
        """A cell passes with a diff that has no unexplained / incomparable pair and no failed check."""
        return self.diff is not None and not self.diff.failing and self.record.checks_ok


@dataclass(frozen=True)
class EngineRecord:
    """engines/<engine_id>.json: how one engine configuration ran."""

    engine_id: str
    target: str
    kind: str  # "tracekit" | "command" | "url"
    log: str | None  # relative to DIR; None for a `url` target
    command: tuple[str, ...] | None
    url: str | None
    startup_s: float | None
    exit_code: int | None
    self_report: Mapping[str, Any]  # GET /v1/models as the engine answered it, or {"error": ...}
    error: str | None  # set when the engine did not start

    def to_json(self) -> dict:
        d = _fields(self)
        d["command"] = None if self.command is None else list(self.command)
        d["self_report"] = redact(dict(self.self_report))
        return d


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what ran, with what, where, and the sha256 of every file (written last)."""

    tool: str
    git_commit: str | None
    command: str
    host: Mapping[str, Any]
    started_utc: str
    finished_utc: str
    matrix_name: str
    matrix_path: str
    cells: tuple[str, ...]  # cell ids in run order
    engines: tuple[EngineRecord, ...]
    files: Mapping[str, str]  # relative path -> sha256, every file but the manifest and report/
    version: int = VERSION  # the version it was written in (older ones are upgraded on read)
    matrix_sha256: str | None = None  # of DIR/matrix.toml (None: written before shards existed)
    shard: Mapping[str, Any] | None = None  # shard.json's document when this run is one shard (--shard I/N)
    merged: Mapping[str, Any] | None = None  # a merged run: its shards, and the shards and cells missing

    def engine(self, engine_id: str) -> EngineRecord | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)


@dataclass(frozen=True)
class RunView:
    """A run directory as read: its manifest (None: the run did not finish), its cells in run
    order, and the cells that could not be read at all, with the reason."""

    manifest: Manifest | None
    cells: tuple[LoadedCell, ...]
    unreadable: tuple[tuple[str, str], ...] = ()  # (cell id, error)


def _fields(obj) -> dict:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
