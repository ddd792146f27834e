"""`tracekit explain` checks the engine it is given against the traces (issue 24 item 1).

Before, explain ran on whatever engine it was pointed at: a BF16 cache-on engine "explained"
the cache-off and FP32 cells of a run, and the URL was not even recorded. Now each URL's
self-report (family, model, dtype, slots, prefix cache, batch invariance, injected fault) is
compared with B's run metadata (and the model with A's) before anything runs: a mismatch is one
line naming each differing fact, unless --allow-engine-mismatch; explain.json records the URL,
the facts and the raw self-report either way.

A = a BF16 engine with 2 slots, serial; B = an FP32 4-slot engine whose prefix cache serves the
wrong block (its flips are real and diverge from A); --url at A's engine is not B's engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.analyze.explain import select_pairs
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.engine.process import start_engine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"


def _capture(url, out):
    cfg = CaptureConfig(url=url, prompts=str(PROMPTS), out=str(out), top_logprobs=5, max_tokens=6, progress=False)
    assert run_capture(cfg).counts["ok"] == 8
    return str(out)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    other_args = ["--threads", "1", "--slots", "2", "--dtype", "bf16"]
    b_args = ["--threads", "1", "--slots", "4", "--inject-fault", "corrupt-prefix-cache"]
    with start_engine(other_args, log_path=str(d / "other.log")) as other:
        a = _capture(other.url, d / "a.h5")
        with start_engine(b_args, log_path=str(d / "b.log")) as b_engine:
            b = _capture(b_engine.url, d / "b.h5")
            pairs, _, _ = select_pairs(a, b)
            assert pairs, "the fault made no divergent pair"
            yield a, b, pairs[0]["key"], other, b_engine


def _explain(*args):
    cmd = [sys.executable, "-m", "tracekit", "explain", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)


def test_another_engine_is_refused_in_one_line_naming_each_fact(engines, tmp_path):
    a, b, key, other, _ = engines
    out = _explain(a, b, "--url", other.url, "--keys", key, "--repeats", "1", "--out", tmp_path / "ex")
    assert out.returncode == 3 and out.stdout == "", out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: explain --url " + other.url), out.stderr
    line = lines[0]
    for fact in (
        "dtype bf16 at the URL, fp32 in the trace",
        "slots 2 at the URL, 4 in the trace",
        "inject_fault none at the URL, corrupt-prefix-cache in the trace",
        "--allow-engine-mismatch",
    ):
        assert fact in line, line
    assert "B (b.h5)" in line and "A (a.h5)" not in line  # A is checked on its model only: the same
    assert not (tmp_path / "ex" / "variants-engine.h5").exists()  # nothing ran


def test_the_engine_b_ran_on_passes_and_is_recorded(engines, tmp_path):
    a, b, key, _, b_engine = engines
    out = _explain(a, b, "--url", b_engine.url, "--keys", key, "--repeats", "1", "--out", tmp_path / "ex", "--json")
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads((tmp_path / "ex" / "explain.json").read_text())
    eng = doc["engines"]["engine"]
    assert eng["url"] == b_engine.url and eng["dialect"] == "vllm"
    f = eng["facts"]
    assert (f["family"], f["dtype"], f["slots"], f["prefix_cache"], f["inject_fault"]) == (
        "tracekit", "fp32", 4, True, "corrupt-prefix-cache",
    )  # fmt: skip
    assert eng["mismatches"] == {} and not eng["mismatch_allowed"] and eng["checked_against"] == ["A", "B"]
    assert eng["self_report"]["v1_models"]["meta"]["slots"] == 4
    note = next(n for n in json.loads(out.stdout)["notes"] if n.startswith("engine configuration:"))
    assert b_engine.url in note and "matches A on model; B on family, model, dtype, slots" in note


def test_allowed_mismatch_runs_and_says_so(engines, tmp_path):
    a, b, key, other, _ = engines
    out = _explain(
        a, b, "--url", other.url, "--keys", key, "--repeats", "1", "--out", tmp_path / "ex", "--allow-engine-mismatch"
    )
    assert out.returncode in (0, 1), out.stderr
    assert "MISMATCH explained anyway (--allow-engine-mismatch)" in out.stdout and other.url in out.stdout
    doc = json.loads((tmp_path / "ex" / "explain.json").read_text())
    eng = doc["engines"]["engine"]
    assert eng["mismatch_allowed"] and eng["url"] == other.url
    assert {m["fact"] for m in eng["mismatches"]["B"]} == {"dtype", "slots", "inject_fault"}
    assert (tmp_path / "ex" / "variants-engine.h5").is_file()
