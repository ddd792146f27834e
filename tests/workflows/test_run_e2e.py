"""The Must-show: the small CPU matrix (fixtures/matrix/cpu_small.toml) end to end
against the reference engine — FP32 and BF16, prefix cache on and off,
concurrency 4 and 8, plus one cell on an engine with the injected fault
(corrupt-prefix-cache). The healthy cells pass; the faulty cell is flagged by
the report with unexplained divergences and a failed check, and the run exits 1.
Also: an engine that cannot start fails its cells (its log kept); the demo runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
FAULT = "ref-fault.fp32.cache-on.cpu_small.out32.c8"
pytestmark = pytest.mark.slow


def tk(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "cpu_small"
    p = tk("run", ROOT / "fixtures/matrix/cpu_small.toml", "--out", out)
    assert p.returncode == 1, p.stderr  # the faulty cell fails the run
    assert "8/9 cells pass" in p.stdout
    return out


def test_report_flags_the_faulty_cell_and_passes_the_healthy_ones(run_dir):
    p = tk("report", run_dir, "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    cells = {c["id"]: c for c in doc["cells"]}
    assert len(cells) == 9 and doc["failed_cells"] == [FAULT]
    bad = cells[FAULT]
    assert bad["verdict"] == "fail" and bad["classes"]["unexplained"] >= 1
    assert "cancel_then_match" in bad["failed_checks"]
    for cid, c in cells.items():
        if cid == FAULT:
            continue
        assert c["verdict"] == "pass" and not c["failed_checks"], c
        assert set(c["checks"]) == {
            "completion_serial",
            "completion_burst",
            "prefix_cache",
            "cancel_drain",
            "cancel_then_match",
            "bad_request",
            "calibration",  # the run-level flip test against this engine's calibration (workflows/judge.py)
            "cold_reference",  # the burst against the cold reference: cache on only (off: the baseline is cold)
        }
        assert all(v == "pass" for k, v in c["checks"].items() if k != "cold_reference"), c["checks"]
        assert c["checks"]["cold_reference"] == ("pass" if c["prefix_cache"] else "skip"), c["checks"]
        engine = f"{c['target']}.{c['dtype']}.cache-{'on' if c['prefix_cache'] else 'off'}"
        assert doc["yardstick"]["cells"][cid]["calibration"] == f"calibration/{engine}.json"
        assert c["classes"]["unexplained"] == c["classes"]["incomparable"] == 0
        if c["dtype"] == "fp32":  # FP32 controls: serial == concurrent, N/N
            assert c["equality"] == "8/8", c
        assert c["perf"]["tokens_per_s"] > 0 and c["perf"]["ttft_ms_p50"] > 0
        # Each burst capture recorded the engine's counters around itself; the reference engine
        # gives every piece of evidence, so no capture warned of a pitfall.
        reuse = c["prefix_reuse"]
        assert reuse["counters"]["family"] == "tracekit" and reuse["cached_reported"] == 8, reuse
        assert (reuse["counters"]["hits_delta"] > 0) == (c["prefix_cache"] and reuse["reused"] > 0)
        assert c["pitfalls"] == []
    # the fault target never calibrates: its cell borrows the healthy FP32 cache-on engine's record
    assert sorted(doc["yardstick"]["calibrations"]) == [
        f"calibration/ref.{d}.cache-{c}.json" for d in ("bf16", "fp32") for c in ("off", "on")
    ]
    assert doc["yardstick"]["cells"][FAULT]["calibration"] == "calibration/ref.fp32.cache-on.json"
    assert "borrowed" in doc["yardstick"]["cells"][FAULT]["said"]
    md = (run_dir / "report" / "report.md").read_text()
    assert "### Yardstick: calibration and references" in md
    assert f"**{FAULT}**" in md and "**FAIL**" in md and "8/9 cells pass" in md


def test_checks_keep_their_evidence(run_dir):
    checks = {c["name"]: c for c in json.loads((run_dir / "cells" / FAULT / "checks.json").read_text())["checks"]}
    m = checks["cancel_then_match"]
    assert m["status"] == "fail" and m["evidence"]["baseline"]["cached_tokens"] > 0
    assert m["evidence"]["first_difference_vs_baseline"] is not None
    healthy = json.loads((run_dir / "cells/ref.bf16.cache-on.cpu_small.out32.c8/checks.json").read_text())["checks"]
    h = {c["name"]: c for c in healthy}
    assert h["cancel_drain"]["evidence"]["cancelled_counter_delta"] == 8  # every dropped stream was seen
    assert h["cancel_drain"]["evidence"]["running"] == 0
    assert h["prefix_cache"]["evidence"]["reused"] == 8  # burst re-sent cached prompts
    # ... and the engine's hit counter, as the burst's capture recorded it, moved as much.
    assert h["prefix_cache"]["evidence"]["counter"] == "tracekit:prefix_cache_hits_total"
    assert h["prefix_cache"]["evidence"]["counter_delta"] > 0
    assert h["bad_request"]["evidence"]["http_status"] == 400
    off = json.loads((run_dir / "cells/ref.fp32.cache-off.cpu_small.out32.c4/checks.json").read_text())["checks"]
    off_cache = next(c for c in off if c["name"] == "prefix_cache")["evidence"]
    assert off_cache["reused"] == 0 and off_cache["counter_delta"] == 0


def test_manifest_hashes_every_file_and_records_the_engines(run_dir):
    man = json.loads((run_dir / "manifest.json").read_text())
    assert man["schema"] == "tracekit.run-manifest/2" and man["tool"].startswith("tracekit ")
    assert man["git_commit"] and man["host"]["cpus"] and "tracekit run" in man["command"]
    files = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    hashed = set(man["files"])
    assert hashed == {f for f in files if f != "manifest.json" and not f.startswith("report/")}
    for rel, sha in man["files"].items():
        assert hashlib.sha256((run_dir / rel).read_bytes()).hexdigest() == sha
    eng = man["engines"]["ref-fault.fp32.cache-on"]
    assert "--inject-fault" in eng["command"] and (run_dir / eng["log"]).is_file()
    meta = eng["self_report"]["v1_models"]["data"][0]["meta"]
    assert meta["inject_fault"] == "corrupt-prefix-cache" and eng["exit_code"] is not None
    assert (run_dir / "matrix.toml").read_text().startswith("# A small matrix")


def test_plots_are_pngs(run_dir):
    for name in ("classes", "gaps", "drift"):
        data = (run_dir / "report" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_engine_that_does_not_start_fails_its_cells(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(
        f'[[prompts]]\nname = "p"\npath = "{ROOT}/fixtures/prompts/cpu_small.jsonl"\n'
        '[[target]]\nname = "broken"\nserve = ["--model", "/nonexistent/model"]\n'
        "[run]\nready_timeout_s = 60\n"
    )
    out = tmp_path / "out"
    p = tk("run", m, "--out", out, "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    (cell,) = doc["cells"]
    assert cell["verdict"] == "fail" and cell["failed_checks"] == ["engine_start"]
    assert (out / "engines" / "broken.fp32.cache-on.log").stat().st_size > 0
