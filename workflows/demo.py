"""The demo: the whole method on the embedded default (`tracekit demo`).

Runs fixtures/matrix/demo.toml (the reference engine with the tiny fixture model; FP32
and BF16 with prefix reuse; serial baseline vs concurrent bursts; the same engine with
--batch-invariant in BF16) with the teacher-forced replay of every divergent key. The run
calibrates itself (workflows/judge.py): each engine configuration's calibration from a
repeat of its bursts (calibration/<engine>.json), every cell judged with it, against the
warm serial baseline, the cold reference (prefix cache reset before each request) and,
where the replay ran, its FP32 rows. Then it explains every cell with divergent pairs
against fresh engines of the cell's configuration and of the target's deterministic and
FP32 variants (started here on 127.0.0.1, stopped after) with the cell's calibration,
writes the report and returns the evidence page (also kept as DIR/report/demo_stdout.txt).

The verdict is ok when it ran, the FP32 controls and the deterministic cells are N/N
identical, every cell passes (its checks include the run-level calibration test and the
cold reference) and explain gives every pair a cause: BF16 divergences are the expected
finding, not a failure; a pair explain calls `bug` or `unresolved` fails the demo, as it
makes `tracekit explain` exit 1 (a near-tie no sampled run tipped, at a gap the healthy
repeats flip at, is `calibrated_noise`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tracekit.analyze import explain_cells
from tracekit.analyze.demo_report import demo_page, demo_verdict, write_demo_page
from tracekit.analyze.run_report import write_report
from tracekit.capture.matrix import Matrix, load_matrix
from tracekit.errors import TracekitError
from tracekit.rundir import RunDir, now_utc
from tracekit.runinfo import REPO_ROOT

from .explain import ExplainOptions, explain_run_cells
from .matrix import TeacherPlan, run

MATRIX = REPO_ROOT / "fixtures" / "matrix" / "demo.toml"
REPEATS = 3  # runs of each explain variant on the cell's own configuration
CONFIG_REPEATS = 1  # ... on the deterministic and FP32 configurations (they only confirm one token)


@dataclass(frozen=True)
class DemoResult:
    root: Path
    page: str  # what the demo prints (and keeps as report/demo_stdout.txt)
    ok: bool


def _explain(root: Path, m: Matrix, repeats: int) -> tuple[list, str | None]:
    """Explain every divergent cell on engines started here; record them in the manifest.
    Returns (the engines' records, the error that stopped it or None)."""
    # engine_replay: each flip's tokens also replayed through the cell's own engine (cold, at A's and
    # at B's boundary): its own logits, not HF's, decide a cache-history cause.
    opts = ExplainOptions(url="", repeats=repeats, config_repeats=min(CONFIG_REPEATS, repeats), engine_replay=True)
    error, records = None, []
    try:
        # No teacher-forced replay here: the run's teacher step already replayed every divergent key.
        _, records = explain_run_cells(root, m, opts, teacher=False)
    except TracekitError as e:
        error = str(e)
    rd = RunDir(root)
    man = rd.read_manifest()
    if man is not None:  # the explain traces and engines join the manifest's hashes and engines
        engines = man.engines + tuple(records)
        rd.write_manifest(dataclasses.replace(man, engines=engines, files=rd.file_hashes(), finished_utc=now_utc()))
    return records, error


def run_demo(root: Path, repeats: int = REPEATS) -> DemoResult:
    """Run, explain and report the demo matrix into the new directory `root`."""
    t0 = time.perf_counter()
    m = load_matrix(MATRIX)
    print(f"tracekit demo: running {MATRIX.relative_to(REPO_ROOT)} into {root}/", file=sys.stderr, flush=True)
    run(m, root, teacher=TeacherPlan())
    print("tracekit demo: explaining each divergent pair on live engines", file=sys.stderr, flush=True)
    _, error = _explain(root, m, repeats)
    report = write_report(root)
    causes = explain_cells.load(root, [r.cell for r in report.rows])
    det = tuple(t.name for t in m.targets if "--batch-invariant" in t.args)
    verdict = demo_verdict(list(report.rows), det, root, causes)
    if error is not None:
        verdict = dataclasses.replace(verdict, ok=False, lines=(*verdict.lines, f"FAIL: explain did not run: {error}"))
    reps = min(CONFIG_REPEATS, repeats)
    sampled = (
        f"every divergent pair of every cell, {repeats} runs of each variant on a fresh engine of the cell's "
        f"configuration, {reps} on its deterministic and FP32 configurations"
    )
    page = demo_page(report, verdict, time.perf_counter() - t0, causes, sampled)
    write_demo_page(report, page)
    return DemoResult(root, page, verdict.ok)
