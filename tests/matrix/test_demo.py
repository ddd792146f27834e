"""`tracekit demo`: real BF16 divergences beside FP32 controls at N/N, exit 0;
and the verdict fails loudly when an FP32 control is not N/N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyze.matrix_report import CellRow
from tracekit.cli.demo import verdict

ROOT = Path(__file__).resolve().parents[2]


def _row(dtype: str, identical: int, pairs: int = 8, flips: int = 0) -> CellRow:
    summary = {
        "pairs": pairs,
        "identical": identical,
        "bf16_tie_flip": flips,
        "cache_boundary": 0,
        "post_eos": 0,
        "unexplained": pairs - identical - flips,
        "incomparable": 0,
    }
    return CellRow({"id": f"ref.{dtype}", "dtype": dtype}, summary, ())


def test_verdict_fails_when_fp32_control_is_not_n_of_n():
    ok, lines = verdict([_row("fp32", 7), _row("bf16", 6, flips=2)])
    assert not ok and lines[0].startswith("FAIL: FP32 control is NOT N/N: 7/8")


def test_verdict_passes_with_bf16_flips_and_fp32_n_of_n():
    ok, lines = verdict([_row("fp32", 8), _row("bf16", 6, flips=2)])
    assert ok and "8/8 identical" in lines[0] and "2 of 8 pairs diverge: 2 bf16_tie_flip" in lines[1]
    assert "expected finding, not a failure" in lines[1]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
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
    man = json.loads((out / "manifest.json").read_text())
    assert man["teacher_forced"]
    for cid in man["teacher_forced"]:
        pairs = json.loads((out / "cells" / cid / "diff.json").read_text())["pairs"]
        div = [q for q in pairs if q["class"] != "identical"]
        assert div and all(q["teacher"] for q in div)
        assert f"cells/{cid}/teacher.h5" in man["files"]
    for name in ("classes", "gaps", "drift"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
