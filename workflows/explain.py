"""Explain: the cause of each flip (`tracekit explain A.h5 B.h5 --url URL`, `RUN_DIR --url URL`,
and the demo's explain step).

The one place that wires the three steps: `tracekit.analyze.explain.select_pairs`
(which pairs diverge, from the diff), `tracekit.capture.explain` (rerun them under
controlled variants on the live engine(s), replay them teacher-forced),
`tracekit.analyze.explain.explain` (score the runs, name the cause). `explain_files` is
the entry for one A/B pair of traces; `explain_run_cells` for every divergent cell of a
run directory, on engines it starts from the matrix."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from tracekit.analyze.explain import explain, select_pairs
from tracekit.calibration import read_calibration
from tracekit.capture.explain import ReplayConfig, VariantConfig, identity, plan_targets, replay, run_variants
from tracekit.capture.explain.engines import start_configs
from tracekit.rundir import RunDir, write_explain

from .judge import cell_calibration


@dataclass(frozen=True)
class ExplainOptions:
    url: str
    repeats: int = 5
    model_dir: str | None = None  # teacher-forced replay
    dtypes: str = "fp32,bf16"
    device: str = "cpu"
    deterministic_url: str | None = None
    fp32_url: str | None = None
    top_logprobs: int = 5
    drift_nats: float | None = None  # the numeric bound; None: from `calibration`, else the documented default
    timeout_s: float = 600.0
    api_key_env: str | None = None
    config_repeats: int | None = None  # runs of each variant on the deterministic / FP32 configurations
    calibration: str | None = None  # a tracekit.calibration record of this engine (`tracekit calibrate`)
    allow_engine_mismatch: bool = False  # explain on an engine whose self-report differs from the traces'
    engine_replay: bool = False  # the engine's own teacher-forced replay (cold, at A's and B's boundary)
    reference: str | None = None  # an FP32 replay of A's tokens for the run-level test; None: made with model_dir


def log(msg: str) -> None:
    """Progress on stderr, only on a terminal (stdout carries the verdicts)."""
    if sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)


def explain_files(a: str, b: str, root: Path, o: ExplainOptions, keys: list[str] | None = None):
    """Explain the divergent (or chosen) pairs of A and B; traces and explain.json under root.
    Returns the ExplainResult."""
    pairs, skipped, _ = select_pairs(a, b, keys)
    notes, variants, teacher, mates, engines, engine_rows = [], [], None, {}, {}, None
    if pairs:
        engines, notes = check_engines(a, b, o)  # before anything runs: a mismatch stops here
        variants, teacher, mates, run_notes, engine_rows = _run(a, b, pairs, root, o)
        notes += run_notes
    cal = read_calibration(o.calibration) if o.calibration else None
    finding = None
    if pairs and cal is not None:
        finding, line = run_level(a, b, cal, root, o)
        notes.append(line)
    result = explain(
        a,
        b,
        pairs,
        [str(v) for v in variants],
        teacher,
        mates,
        skipped,
        o.drift_nats,
        notes,
        calibration=cal,
        engine_replay=engine_rows,
        run_finding=finding,
    )
    if pairs:
        doc = result.to_json()
        doc["traces"] = {"variants": [v.name for v in variants], "teacher_forced": teacher and Path(teacher).name}
        if engine_rows:
            doc["traces"]["engine_replay"] = Path(engine_rows).name
        doc["engines"] = engines  # config -> URL, self-report, facts, what it was checked against
        write_explain(root, doc)
    return result


def run_level(a: str, b: str, cal, root: Path, o: ExplainOptions) -> tuple[str | None, str]:
    """A vs B judged as `diff --calibration --reference` judges them (the run-level flip test, and
    the run-level test against an FP32 replay of A's tokens: o.reference, else made here from
    o.model_dir for every request of A): (the finding or None, the note line)."""
    from tracekit.analyze import diff
    from tracekit.analyze.compare import reference_line
    from tracekit.analyze.explain_noise import run_finding

    ref = o.reference
    if ref is None and o.model_dir:
        from tracekit.capture.teacher import TeacherConfig, run_teacher

        root.mkdir(parents=True, exist_ok=True)
        ref = str(root / "reference.h5")
        Path(ref).unlink(missing_ok=True)
        log(f"explain: FP32 teacher-forced full replay of every request of A -> {ref}")
        run_teacher(TeacherConfig(o.model_dir, ref, "full", "fp32", from_path=str(a), device=o.device))
    res = diff(a, b, calibration=cal, reference=ref)
    parts = [res.flip_test.line()] + ([reference_line(res.reference)] if res.reference is not None else [])
    if ref is None:
        parts.append("no reference for the run-level test (give --reference or --teacher-forced MODEL_DIR)")
    finding = run_finding(res)
    head = f"run-level test FAILED ({finding})" if finding else "run-level test passed"
    return finding, f"{head}, A vs B as `diff --calibration --reference` judges them: " + "; ".join(parts)


def check_engines(a: str, b: str, o: ExplainOptions) -> tuple[dict, list[str]]:
    """Each given URL's self-report against A's and B's run metadata (capture/explain/identity.py):
    ({config: explain.json entry}, note lines). Raises ConfigError on a mismatch unless allowed."""
    traces = [("A", a, identity.trace_facts(a)), ("B", b, identity.trace_facts(b))]
    engines, notes = {}, []
    for config, url in (("engine", o.url), ("deterministic", o.deterministic_url), ("fp32", o.fp32_url)):
        if url:
            report = identity.probe_engine(url, o.api_key_env, o.timeout_s)
            engines[config], note = identity.check(config, report, traces, o.allow_engine_mismatch)
            notes.append(note)
    return engines, notes


def _run(a, b, pairs, root: Path, o: ExplainOptions):
    """Plan the targets, run the variants on each given URL and the teacher-forced replay."""
    targets = plan_targets(a, b, pairs)
    root.mkdir(parents=True, exist_ok=True)
    notes, variants, teacher = [], [], None
    for config, url in (("engine", o.url), ("deterministic", o.deterministic_url), ("fp32", o.fp32_url)):
        if not url:
            notes.append(f"{config} configuration: not run (no --{config}-url)")
            continue
        path = root / f"variants-{config}.h5"
        reps = o.repeats if config == "engine" or o.config_repeats is None else o.config_repeats
        vcfg = VariantConfig(url, str(path), config, reps, o.top_logprobs, o.timeout_s)
        log(f"explain: {len(targets)} pairs x {reps} repeats on {url} ({config}) -> {path}")
        s = run_variants(dataclasses.replace(vcfg, api_key_env=o.api_key_env), targets)
        notes += s.notes
        variants.append(path)
    if o.model_dir:
        teacher = str(root / "teacher.h5")
        log(f"explain: teacher-forced replay of {len(targets)} pairs -> {teacher}")
        dts = tuple(d.strip() for d in o.dtypes.split(",") if d.strip())
        replay(ReplayConfig(o.model_dir, teacher, dts, o.device, o.top_logprobs), targets)
    else:
        notes.append("teacher-forced replay: not run (no --teacher-forced MODEL_DIR)")
    engine_rows = _engine_replay(b, targets, root, o, notes) if o.engine_replay else None
    return variants, teacher, {t.key: len(t.mates) for t in targets}, notes, engine_rows


def _engine_replay(b: str, targets, root: Path, o: ExplainOptions, notes: list[str]) -> str:
    """The engine's own teacher-forced replay of every target on o.url (A's tokens up to t; cold,
    at A's and at B's boundary; capture/replay_http.py): rows `engine:cold` / `engine:warm:B`."""
    import os

    from tracekit.capture.explain.replay import engine_replay
    from tracekit.store import TraceReader

    with TraceReader(b) as r:
        run = {k: v for k, v in r.meta.run.items() if k in ("model", "eos_token_ids", "dtype", "dtype_source")}
    path = root / "engine-replay.h5"
    log(f"explain: engine-side replay of {len(targets)} pairs on {o.url} -> {path}")
    key = os.environ.get(o.api_key_env) if o.api_key_env else None
    s = engine_replay(o.url, str(path), targets, run, o.top_logprobs, o.timeout_s, key)
    notes.append(
        f"engine-side replay on {o.url} ({s.engine}, {s.method}): {s.ok}/{s.rows} rows with their history proven"
        + (f"; refused: {'; '.join(s.refused)}" if s.refused else "")
        + (f"; not achieved: {'; '.join(s.failed[:3])}" if s.failed else "")
    )
    return str(path)


def explain_run_cells(root: Path, m, o: ExplainOptions, only: list[str] | None = None, teacher: bool = True):
    """Explain every divergent cell of a `tracekit run` directory on engines started here from the
    matrix `m`: per engine configuration, a fresh engine of the cell's own configuration and the
    target's named variants (deterministic, FP32; capture/explain/engines.py), judged with the
    calibration the run judged the cell with (`o.calibration` when given), and with `teacher`
    the teacher-forced replay on the target's model (`o.model_dir`, else the target's). Traces and
    explain.json under DIR/cells/<id>/explain/ (RunDir.explain_dir); engine logs under DIR/engines/explain/.
    Returns ([(cell id, ExplainResult)], the engines' records)."""
    rd = RunDir(root)
    jobs = [(rd.read_cell(cid).cell, a, b) for cid, a, b in run_dir_cells(root, only)]
    results, records = [], []
    for engine_id in dict.fromkeys(c.engine_id for c, _, _ in jobs):
        group = [j for j in jobs if j[0].engine_id == engine_id]
        log(f"explain: starting the engines of {engine_id}")
        eng = start_configs(m, group[0][0], rd.root / "engines" / "explain")
        for note in eng.notes:
            print(f"explain: {note}", file=sys.stderr, flush=True)
        try:
            for cell, a, b in group:
                log(f"explain: cell {cell.id}")
                co = dataclasses.replace(
                    o,
                    # the calibration the run judged the cell with (workflows/judge.py), unless one was given
                    calibration=o.calibration or cell_calibration(rd, cell.id),
                    url=eng.urls["engine"],
                    deterministic_url=eng.urls.get("deterministic"),
                    fp32_url=eng.urls.get("fp32"),
                    model_dir=(o.model_dir or m.model_dir(cell.target)) if teacher else None,
                )
                results.append((cell.id, explain_files(a, b, rd.explain_dir(cell.id), co)))
        finally:
            records += eng.stop()
    return results, records


def run_dir_cells(root: Path, only: list[str] | None) -> list[tuple[str, str, str]]:
    """(cell id, A, B) of each cell of a run directory whose diff has divergent pairs."""
    rd = RunDir(root)
    out = []
    for c in rd.load()[1]:
        rec = c.record
        if only and rec.cell.id not in only:
            continue
        if c.diff is None or rec.baseline is None or rec.burst is None:
            continue
        if any(p.position is not None and p.cls not in ("identical", "incomparable") for p in c.diff.pairs):
            out.append((rec.cell.id, str(rd.path(rec.baseline)), str(rd.path(rec.burst))))
    return out
