"""`tracekit demo`: real BF16 divergences beside FP32 controls at N/N, exit 0;
and the verdict fails loudly when an FP32 control is not N/N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.analyze.demo_report import demo_verdict
from tracekit.analyze.run_report import CellRow
from tracekit.rundir import Cell, CellRecord, DiffRef, DiffSummary, LoadedCell, PairEvidence, RunDir
from tracekit.workflows.matrix import side_histories

ROOT = Path(__file__).resolve().parents[2]


def _row(dtype: str, identical: int, pairs: int = 8, flips: int = 0, target: str = "ref") -> CellRow:
    counts = {
        "pairs": pairs,
        "identical": identical,
        "bf16_tie_flip": flips,
        "cache_boundary": 0,
        "post_eos": 0,
        "unexplained": pairs - identical - flips,
        "incomparable": 0,
    }
    rec = CellRecord(Cell(target, dtype, True, "p", 32, 8), "a.h5", "b.h5", (), DiffRef("d.json", None))
    return CellRow(LoadedCell(rec, DiffSummary("a.h5", "b.h5", counts, {}, ()), None))


def test_verdict_fails_when_fp32_control_is_not_n_of_n():
    v = demo_verdict([_row("fp32", 7), _row("bf16", 6, flips=2)])
    assert not v.ok and v.lines[0].startswith("FAIL: FP32 control is NOT N/N: 7/8")


def test_verdict_passes_with_bf16_flips_and_fp32_n_of_n():
    v = demo_verdict([_row("fp32", 8), _row("bf16", 6, flips=2)])
    assert v.ok and "8/8 identical" in v.lines[0] and "2 of 8 pairs diverge: 2 bf16_tie_flip" in v.lines[1]
    assert "expected finding, not a failure" in v.lines[1]


def test_verdict_fails_when_the_deterministic_configuration_flips():
    """The --batch-invariant row is a control like FP32: a batch-dependent token there is a failure,
    while the same flips on the default engine are the finding."""
    det = ("ref-bi",)
    v = demo_verdict([_row("fp32", 8), _row("bf16", 6, flips=2), _row("bf16", 8, target="ref-bi")], det)
    assert v.ok and "2 of 8 pairs diverge" in v.lines[1]
    assert v.lines[2].startswith("Deterministic configuration (ref-bi, --batch-invariant), BF16: 8/8 identical")
    v = demo_verdict([_row("fp32", 8), _row("bf16", 7, target="ref-bi")], det)
    assert not v.ok and v.lines[2].startswith("FAIL: the deterministic configuration (ref-bi, --batch-invariant)")


def test_verdict_fails_on_a_pair_explain_calls_a_bug_as_explain_exits_1():
    """Issue 24 item 13: the demo and `tracekit explain` agree on what a `bug` line means for the
    exit code: explain exits 1 on it, so the demo fails on it; `calibrated_noise` is a cause."""
    from tracekit.analyze.explain_cells import CellCauses

    cell = Cell("ref", "bf16", True, "p", 32, 8)
    rows = [_row("fp32", 8), _row("bf16", 6, flips=2)]

    def causes(*kinds):
        pairs = [{"key": f"k{i}", "kind": k, "loud": k == "bug", "cause": k} for i, k in enumerate(kinds)]
        return [CellCauses(cell, {"pairs": pairs})]

    assert demo_verdict(rows, causes=causes("batch_composition", "calibrated_noise")).ok
    v = demo_verdict(rows, causes=causes("batch_composition", "bug"))
    assert not v.ok and v.lines[-1].startswith("FAIL: 1 explained pair(s) with no cause")
    assert "ref.bf16.cache-on.p.out32.c8:k1 (bug)" in v.lines[-1] and "`tracekit explain` exits 1" in v.lines[-1]
    assert not demo_verdict(rows, causes=causes("unresolved")).ok


def _pair(key: str, a: int | None, b: int | None) -> PairEvidence:
    return PairEvidence(key, "bf16_tie_flip", 5, 1, 2, 0.0, 0.0, 0.0, 1.0, a, b, 0.0, "tie", None)


def test_prefix_auto_replays_each_sides_boundary_and_says_which():
    """The serial baseline's prefix:auto is A's boundary; where B reused another one (A 0, B 112),
    B's boundary is replayed too, and the pair says which history is whose."""
    hist, said = side_histories("full,prefix:auto,decode", [_pair("p00", 0, 112), _pair("p01", 96, 96)])
    assert hist == "full,prefix:auto,decode,prefix:112"
    assert said == ["p00: reused prefix A 0 / B 112: prefix:auto replays A's (0: nothing reused, that is `full`), "
                    "prefix:112 replays B's"]  # fmt: skip
    assert side_histories("full,decode", [_pair("p00", 0, 112)]) == ("full,decode", [])
    assert side_histories("full,prefix:auto", [_pair("p00", None, 112)]) == ("full,prefix:auto", [])


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
    assert (
        "Deterministic configuration (ref-batch-invariant, --batch-invariant), BF16: 16/16 identical, 16/16 bitwise"
        in (p.stdout)
    )
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
    # Every divergent pair of the default engine got a cause from live runs, in the report too.
    div = {(c.cell.id, q.key) for c in cells if c.cell.target == "ref" for q in c.diff.pairs if q.position is not None}
    explained = {(c["id"], q["key"]) for c in doc["explain"]["cells"] for q in c["pairs"] if q["kind"] and q["cause"]}
    assert div and explained == div
    assert doc["explain"]["counts"]["pairs"] == len(div) and "Cause of each flip" in p.stdout
    md = (out / "report" / "report.md").read_text()
    assert "### Cause of each flip" in md and all(f"| {k} " in md for _, k in div)
    assert all(q in man.files for c, _ in div for q in [f"cells/{c}/explain/variants-engine.h5"])
    # Issue 22 / 24 item 13: the run calibrated itself on healthy repeats and judged every cell with
    # it and against the cold reference; no healthy pair of the demo is reported as a bug.
    assert "report as a bug" not in p.stdout and "LOUD" not in p.stdout
    assert all(q["kind"] != "bug" and not q["loud"] for c in doc["explain"]["cells"] for q in c["pairs"])
    cals = sorted(x.name for x in (out / "calibration").iterdir())
    assert cals == ["ref-batch-invariant.bf16.cache-on.json", "ref.bf16.cache-on.json", "ref.fp32.cache-on.json"]
    assert "Yardstick: calibration and references" in p.stdout and "calibration/ref.bf16.cache-on.json" in p.stdout
    for c in cells:
        checks = {k.name: k for k in c.record.checks}
        assert checks["calibration"].status == "pass", checks["calibration"].summary
        assert checks["calibration"].evidence["calibration"] == f"calibration/{c.cell.engine_id}.json"
        assert checks["cold_reference"].status == "pass", checks["cold_reference"].summary
        assert f"cells/{c.cell.id}/diff-cold.json" in man.files
    for c in doc["explain"]["cells"]:  # explain used the cell's calibration, not the 0.5-nat default
        ex = json.loads((out / "cells" / c["id"] / "explain" / "explain.json").read_text())
        assert any("measured: calibration ref.bf16.cache-on" in n for n in ex["notes"]), ex["notes"]
    # What the README promises: the demo's stdout kept beside the report.
    assert (out / "report" / "demo_stdout.txt").read_text() == p.stdout
