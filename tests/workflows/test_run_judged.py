"""A matrix run judges itself: calibrations from healthy repeats only, and a cold reference.

The prefix-cache-key bug (`--inject-fault prefix-key-collision:4`, tracekit/engine/faults.py: a
block's hash ignores its last 4 tokens) serves p2 the KV of the header's third block although
p2's last 4 ids of that block differ. The warm serial baseline ran on the same engine and was
served the same wrong block, so serial vs burst reads "identical"; the cold reference (prefix
cache reset before each request) computes p2 itself and catches it. The healthy target's
calibration comes from its own repeats only; the fault target borrows it and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
TAG = list(range(100, 116))
HEADER = TAG + list(range(300, 332))  # 3 blocks of 16
PROMPTS = {  # p2 differs from the header only in the last 4 ids of block 3 (tests/tracekit/engine)
    "p0": HEADER + list(range(400, 420)),
    "p1": HEADER + list(range(500, 505)),
    "p2": HEADER[:44] + [7, 8, 9, 10] + list(range(600, 610)),
    "p3": TAG + list(range(700, 708)),
}
MATRIX = """
name = "collision"
[run]
ignore_eos = true
top_logprobs = 5
timeout_s = 120
ready_timeout_s = 120
[checks]
cancel_after_tokens = 2
drain_timeout_s = 10
[[prompts]]
name = "collide"
path = "collide.jsonl"
[axes]
concurrency = [4]
dtype = ["fp32"]
prefix_cache = [true]
output_tokens = [8]
[[target]]
name = "ref"
model = "{model}"
serve = ["--threads", "1", "--slots", "4"]
[[target]]
name = "ref-fault"
model = "{model}"
serve = ["--threads", "1", "--slots", "4", "--inject-fault", "prefix-key-collision:4"]
"""
HEALTHY = "ref.fp32.cache-on.collide.out8.c4"
FAULT = "ref-fault.fp32.cache-on.collide.out8.c4"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("judged")
    (d / "collide.jsonl").write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in PROMPTS.items()))
    (d / "m.toml").write_text(MATRIX.replace("{model}", str(ROOT / "fixtures" / "models" / "tiny")))
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "run", str(d / "m.toml"), "--out", str(d / "run"), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
        cwd=ROOT,
    )
    assert p.returncode == 1, p.stderr  # the fault cell fails, on the cold reference only
    return d / "run", json.loads(p.stdout)


def _checks(root: Path, cell: str) -> dict:
    return {c["name"]: c for c in json.loads((root / "cells" / cell / "checks.json").read_text())["checks"]}


def _classes(path: Path) -> dict:
    return {p["key"]: p["class"] for p in json.loads(path.read_text())["pairs"]}


def test_prefix_key_collision_is_identical_warm_but_caught_cold(run_dir):
    root, summary = run_dir
    assert summary["failed_cells"] == [FAULT]
    warm = _classes(root / "cells" / FAULT / "diff.json")
    assert warm == dict.fromkeys(PROMPTS, "identical")  # the warm serial baseline shares the wrong block
    cold = _classes(root / "cells" / FAULT / "diff-cold.json")
    assert cold["p2"] == "unexplained" and cold["p0"] == cold["p1"] == cold["p3"] == "identical"
    check = _checks(root, FAULT)["cold_reference"]
    assert check["status"] == "fail" and "failing: p2" in check["summary"]
    assert "prefix cache reset before each request" in check["summary"]
    # the cold trace: every request met an empty cache
    from tracekit.store import TraceReader

    with TraceReader(root / "groups" / "ref-fault.fp32.cache-on.collide.out8" / "cold.h5") as r:
        assert r.requests.cached_tokens.tolist() == [0, 0, 0, 0]
        assert r.meta.record.mode == "cold"


def test_healthy_cell_passes_both_references_with_its_own_calibration(run_dir):
    root, _ = run_dir
    assert set(_classes(root / "cells" / HEALTHY / "diff-cold.json").values()) == {"identical"}
    checks = _checks(root, HEALTHY)
    assert checks["cold_reference"]["status"] == "pass"
    assert checks["calibration"]["status"] == "pass"
    assert checks["calibration"]["evidence"]["calibration"] == "calibration/ref.fp32.cache-on.json"


def test_calibration_comes_from_healthy_repeats_only_and_the_fault_cell_names_the_one_it_borrowed(run_dir):
    root, _ = run_dir
    assert sorted(p.name for p in (root / "calibration").iterdir()) == ["ref.fp32.cache-on.json"]
    cal = json.loads((root / "calibration" / "ref.fp32.cache-on.json").read_text())
    assert cal["schema"] == "tracekit.calibration/2" and cal["pairs"] == 4 and "gap_move" in cal
    assert "healthy repeats of target ref" in cal["name"]
    srcs = [s[k] for s in cal["sources"] for k in ("a", "b")]
    assert srcs == [
        "groups/ref.fp32.cache-on.collide.out8/serial.h5",
        "groups/ref.fp32.cache-on.collide.out8/repeat-c4-1.h5",
    ]
    assert not (root / "groups" / "ref-fault.fp32.cache-on.collide.out8" / "repeat-c4-1.h5").exists()
    check = _checks(root, FAULT)["calibration"]
    assert check["evidence"]["calibration"] == "calibration/ref.fp32.cache-on.json"
    assert "borrowed: target ref-fault may not calibrate itself" in check["summary"]
    diff = json.loads((root / "cells" / FAULT / "diff.json").read_text())
    assert diff["yardstick"]["calibration"] == "calibration/ref.fp32.cache-on.json"
    assert diff["calibration"]["calibration"].startswith("ref.fp32.cache-on: healthy repeats")
