"""Issue 24 item 16: the README's demo and fault-cell numbers come from runs, not from a keyboard.

`scripts/readme_numbers.py` regenerates the README's marked blocks from the committed demo run
(traces/demo) and the committed cpu_small report (traces/cpu-small/report); the README must equal
what they give, and a hand-edited number is caught."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "readme_numbers.py"


def _module():
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_quotes_the_committed_runs():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--demo", "traces/demo", "--matrix", "traces/cpu-small", "--check", "README.md"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    readme = (ROOT / "README.md").read_text()
    for name in ("demo-run", "demo-page", "demo-example", "demo-noise", "fault"):
        assert f"<!-- readme-numbers:{name} -->" in readme
    assert "--first-divergent" in readme and "--key c0" not in readme


def test_a_hand_typed_number_is_caught(tmp_path):
    mod = _module()
    made = mod.blocks(ROOT / "traces" / "demo", ROOT / "traces" / "cpu-small")
    readme = (ROOT / "README.md").read_text()
    edited = readme.replace(made["demo-run"], "216 s, 9.0 MB\n", 1)
    assert edited != readme
    _, changed = mod.apply(edited, made)
    assert changed == ["demo-run"]


def test_fault_sentence_from_a_summary(tmp_path):
    """The fault block counts the failing cell's unexplained pairs and their ULP gaps from summary.json."""
    mod = _module()
    pair = {"class": "unexplained", "gap_a_ulp": 13.0, "gap_b_ulp": 2.5e6}
    cells = [
        {"id": "ok.cell", "verdict": "pass", "divergent": [], "failed_checks": [], "equality": "8/8"},
        {
            "id": "ref-fault.fp32.cache-on.cpu_small.out32.c8",
            "verdict": "fail",
            "equality": "0/8",
            "divergent": [pair, {**pair, "gap_a_ulp": None}, {"class": "bf16_tie_flip", "gap_a_ulp": 1}],
            "failed_checks": ["cancel_then_match", "cold_reference"],
        },
    ]
    doc = {"cells": cells, "totals": {"passed": 1, "cells": 2}, "matrix": {"name": "cpu-small"}}
    doc["tool"] = "tracekit 0.1.0"
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "summary.json").write_text(json.dumps(doc))
    assert mod.fault(tmp_path) == (
        "1/2 cells pass (`cpu-small`, tracekit 0.1.0):\n"
        "- `ref-fault.fp32.cache-on.cpu_small.out32.c8`: 0/8 identical with 2 `unexplained` pairs (gaps of "
        "13–2.5e+06 ULPs, 1 with a token outside the other side's top-k); failed checks: `cancel_then_match`, "
        "`cold_reference`\n"
    )
