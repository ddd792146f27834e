"""`tracekit demo`: real BF16 divergences beside FP32 controls at N/N, exit 0;
and the verdict fails loudly when an FP32 control is not N/N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyze.demo_report import demo_verdict
from analyze.matrix_report import CellRow
from tracekit.rundir import Cell, CellRecord, DiffRef, DiffSummary, LoadedCell, RunDir

ROOT = Path(__file__).resolve().parents[2]


def _row(dtype: str, identical: int, pairs: int = 8, flips: int = 0) -> CellRow:
    counts = {
        "pairs": pairs,
        "identical": identical,
        "bf16_tie_flip": flips,
        "cache_boundary": 0,
        "post_eos": 0,
        "unexplained": pairs - identical - flips,
        "incomparable": 0,
    }
    rec = CellRecord(Cell("ref", dtype, True, "p", 32, 8), "a.h5", "b.h5", (), DiffRef("d.json", None))
    return CellRow(LoadedCell(rec, DiffSummary("a.h5", "b.h5", counts, {}, ()), None))


def test_verdict_fails_when_fp32_control_is_not_n_of_n():
    v = demo_verdict([_row("fp32", 7), _row("bf16", 6, flips=2)])
    assert not v.ok and v.lines[0].startswith("FAIL: FP32 control is NOT N/N: 7/8")


def test_verdict_passes_with_bf16_flips_and_fp32_n_of_n():
    v = demo_verdict([_row("fp32", 8), _row("bf16", 6, flips=2)])
    assert v.ok and "8/8 identical" in v.lines[0] and "2 of 8 pairs diverge: 2 bf16_tie_flip" in v.lines[1]
    assert "expected finding, not a failure" in v.lines[1]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,  # a hang guard: ~1 min idle, 7+ min on a shared 2-core machine
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "FP32 control: 80/80 identical across 6 cells (N/N, as required)." in p.stdout
    doc = json.loads((out / "report" / "summary.json").read_text())
    bf = [c for c in doc["cells"] if c["dtype"] == "bf16"]
    flips = sum(c["classes"]["bf16_tie_flip"] + c["classes"]["cache_boundary"] for c in bf)
    assert flips >= 1 and doc["failed_cells"] == []
    # Every divergent key got a teacher-forced verdict next to its class.
    man, cells = RunDir(out).load()
    replayed = [c for c in cells if c.record.teacher is not None]
    assert replayed
    for c in replayed:
        div = [q for q in c.diff.pairs if q.cls != "identical"]
        assert div and all(q.teacher for q in div) and {q.key for q in div} == set(c.record.teacher.keys)
        assert c.record.teacher.trace in man.files
    for name in ("classes", "gaps", "drift"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
    # What the README promises: the demo's stdout kept beside the report.
    assert (out / "report" / "demo_stdout.txt").read_text() == p.stdout
