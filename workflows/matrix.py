"""`run(matrix, out)`: a whole matrix run as one library call (`tracekit run`, `tracekit demo`).

Captures every cell (tracekit.capture.matrix.cells), measures each healthy engine
configuration's calibration from its repeats, diffs each cell's burst against its serial
baseline with that calibration (tracekit.analyze; workflows/judge.py), optionally replays the
divergent keys through the teacher-forced diagnostic (tracekit.capture.teacher) and diffs again
with that cross-check and its FP32 rows as the reference, judges the burst against the cold
reference, then hashes DIR into the manifest. Returns the run as read back from DIR. The report
(`tracekit report`) is a separate step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from tracekit import __version__
from tracekit.analyze.run_report import diff_document
from tracekit.capture.matrix.cells import log, run_matrix
from tracekit.capture.matrix.spec import Matrix
from tracekit.errors import TracekitError, UsageError
from tracekit.rundir import CellRecord, DiffRef, LoadedCell, Manifest, RunDir, TeacherRef, now_utc, read_diff
from tracekit.rundir.shards import Shard
from tracekit.runinfo import command_line, git_commit, host_info

from .judge import Yardstick, calibrate_engines, diff_doc, judge_cell, yardstick
from .shards import calibration_unit, shard_cells, shard_info


@dataclass(frozen=True)
class TeacherPlan:
    """The teacher-forced step of `tracekit demo`: replay every divergent key of a cell
    (from its serial baseline) under these histories and dtypes with the target's model."""

    histories: str = "full,prefix:auto,decode"
    dtypes: str = "fp32,bf16"
    device: str = "cpu"  # where the diagnostic runs (cpu | cuda | cuda:N | auto)


@dataclass(frozen=True)
class RunResult:
    root: Path
    manifest: Manifest
    cells: tuple[LoadedCell, ...]

    @property
    def failed_cells(self) -> list[str]:
        return [c.cell.id for c in self.cells if not c.passed]

    @property
    def ok(self) -> bool:
        return not self.failed_cells


def _diff(
    rd: RunDir, r: CellRecord, teacher: Path | None = None, ys: Yardstick | None = None, reference: bool = False
) -> DiffRef:
    if r.baseline is None or r.burst is None:
        return DiffRef(None, "no diff: a capture failed (see its checks)")
    try:
        if ys is None:
            doc = diff_document(rd.path(r.baseline), rd.path(r.burst), teacher)
        else:  # judged with the cell's calibration (and the FP32 teacher-forced replay as the reference)
            doc = diff_doc(rd.path(r.baseline), rd.path(r.burst), ys, teacher, reference)
        return rd.write_diff(r.cell.id, doc, r.baseline, r.burst)
    except TracekitError as e:
        return DiffRef(None, f"diff failed: {e}")
    except Exception as e:  # noqa: BLE001 - an analysis crash on one cell must not lose the run:
        # it is recorded as that cell's diff error (the cell then fails) and the run goes on.
        return DiffRef(None, f"diff crashed: {type(e).__name__}: {e}")


def side_histories(histories: str, pairs) -> tuple[str, list[str]]:
    """The histories to replay and what they mean per pair. The sequences come from the serial
    baseline (A), so `prefix:auto` replays A's boundary; where B reused another boundary, that
    boundary is added as `prefix:<b>` (replayed for every key it fits), and each such pair is said:
    the replay that matters for a flip is often B's (A reused 0, B 112)."""
    if "prefix:auto" not in histories.replace(" ", ""):
        return histories, []
    extra, said = [], []
    for p in pairs:
        a, b = p.boundary_a, p.boundary_b
        if a is None or b is None or a == b:
            continue
        a_says = "0: nothing reused, that is `full`" if a == 0 else ("not reported" if a < 0 else str(a))
        line = f"{p.key}: reused prefix A {a} / B {b}: prefix:auto replays A's ({a_says})"
        if b > 0:
            extra.append(b)
            line += f", prefix:{b} replays B's"
        said.append(line)
    out = histories + "".join(f",prefix:{b}" for b in sorted(set(extra)))
    return out, said


def _teacher(rd: RunDir, m: Matrix, r: CellRecord, plan: TeacherPlan, ys: Yardstick | None = None) -> CellRecord:
    """Replay the cell's divergent keys, then diff again with the cross-check."""
    if r.diff.path is None or m.target(r.cell.target).kind != "tracekit":
        return r
    # The cell's diff as just written (cell.json still says "not computed" until the caller writes it).
    pairs = read_diff(rd.path(r.diff.path)).pairs
    div = [p for p in pairs if p.cls not in ("identical", "incomparable") and p.position is not None]
    keys = tuple(p.key for p in div)
    if not keys:
        return r
    from tracekit.capture.teacher import DiagnosticConfig, from_trace, parse_dtypes, parse_histories, run_diagnostic

    log(f"teacher-forced: {r.cell.id}: {len(keys)} divergent keys")
    histories, said = side_histories(plan.histories, div)
    for line in said:
        log(f"  {line}")
    ref = TeacherRef(rd.teacher_rel(r.cell.id), keys, histories, plan.dtypes, m.model_dir(r.cell.target))
    cfg = DiagnosticConfig(ref.model, parse_histories(histories), parse_dtypes(plan.dtypes), device=plan.device)
    seqs = from_trace(str(rd.path(r.baseline)), list(keys))
    s = run_diagnostic(cfg, seqs, str(rd.path(ref.trace)), extra_run={"from": r.baseline})
    for line in s.skipped:
        log(f"  not replayed: {line}")
    fp32 = "fp32" in plan.dtypes.replace(" ", "").split(",")  # the reference: the replay's FP32 `full` rows
    return dataclasses.replace(r, diff=_diff(rd, r, rd.path(ref.trace), ys, reference=fp32), teacher=ref)


def _resume_plan(rd: RunDir, m: Matrix, info, cells) -> tuple[dict, list]:
    """(the finished cells to keep, id -> record; the cells to run again). The unit is a
    calibration unit (workflows/shards.py: an engine configuration's groups and the cells judged
    with its calibration): it reruns whole (serial baselines, repeats, cold references too)
    unless every one of its cells finished, so each calibration is measured from the same repeats
    as in one uninterrupted run; what an unfinished unit left is removed."""
    had = rd.read_shard()
    if (had is None) != (info is None) or (had and (had.index, had.count) != (info.index, info.count)):
        what = "the whole matrix" if had is None else f"shard {had.index}/{had.count}"
        raise UsageError(f"{rd.root}: holds a run of {what}; resume it with the same --shard (or none)")
    finished = rd.finished_cells()
    units: dict[str, list] = {}
    for c in cells:
        units.setdefault(calibration_unit(m, c), []).append(c)
    kept, todo = {}, []
    for unit in units.values():
        if all(c.id in finished for c in unit):
            kept.update({c.id: rd.read_cell(c.id) for c in unit})
        else:
            for gid in dict.fromkeys(c.group_id for c in unit):
                rd.discard(gid, [c.id for c in unit if c.group_id == gid])
            todo += unit
    log(f"resume: {len(kept)} cells finished and kept, {len(todo)} to run")
    return kept, [c for c in cells if c in todo]


def run(
    m: Matrix,
    out: str | os.PathLike,
    *,
    teacher: TeacherPlan | None = None,
    argv=None,
    shard: Shard | None = None,
    resume: bool = False,
) -> RunResult:
    """Run every cell of m (or of one shard of it) into the new directory `out`, diff, (teacher),
    manifest. With `resume`, `out` is an unfinished run of the same matrix (and shard): its
    finished cells are kept and every other group reruns. Raises ConfigError when `out` already
    holds a run (without `resume`) or a target's api_key_env is unset."""
    for t in m.targets:
        t.api_key()  # fail before anything starts, not on every cell
    info = shard_info(m, shard) if shard is not None else None
    cells = m.cells() if shard is None else shard_cells(m, shard)
    rd, started = (RunDir.reopen(out, m.text) if resume else RunDir.create(out, m.text)), now_utc()
    kept, todo = _resume_plan(rd, m, info, cells) if resume else ({}, cells)
    if info is not None:
        rd.write_shard(info)
        log(f"shard {shard.label}: {len(cells)} of {len(info.matrix_cells)} cells")
    records, engines = run_matrix(m, rd, todo) if todo else ([], [])
    cals = calibrate_engines(rd, m, records)  # from the healthy targets' calibration repeats (judge.py)
    fresh = {}
    for r in records:
        ys = yardstick(m, r.cell, cals)
        r = dataclasses.replace(r, diff=_diff(rd, r, ys=ys))
        if teacher is not None:
            r = _teacher(rd, m, r, teacher, ys)
        r = judge_cell(rd, r, ys)  # the `calibration` and `cold_reference` checks
        rd.write_cell(r)
        fresh[r.cell.id] = r
    done = [kept.get(c.id) or fresh[c.id] for c in cells]
    if resume:  # the engines of the earlier attempt too (those rerun now replace theirs)
        engines = list({e.engine_id: e for e in [*rd.read_engines(), *engines]}.values())
    man = Manifest(
        f"tracekit {__version__}",
        git_commit(),
        command_line(argv),
        host_info(),
        started,
        now_utc(),
        m.name,
        m.path,
        tuple(r.cell.id for r in done),
        tuple(engines),
        rd.file_hashes(),
        matrix_sha256=hashlib.sha256(m.text.encode("utf-8")).hexdigest(),
        shard=None if info is None else info.to_json(),
    )
    rd.write_manifest(man)
    return RunResult(rd.root, man, tuple(rd.load_cell(r.cell.id) for r in done))
