"""`tracekit explain` against live servers: every variant's rows land in the trace format
with what they are, the cache flush really makes a run cold, priming really reuses the
asked boundary, an engine without a flush says the cold variant is unavailable, the
injected-fault engine's pairs come out "not reproduced by any numeric variant", and a
SIGKILL keeps every finished group of rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
from support.replay import ReplayServer, routes_for  # noqa: E402

from tracekit.capture.explain import Mate, Target, VariantConfig, run_variants, tag_of  # noqa: E402
from tracekit.capture.explain.variants import priming  # noqa: E402
from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402
from tracekit.engine.process import start_engine  # noqa: E402
from tracekit.errors import TracekitError  # noqa: E402
from tracekit.store import TraceReader  # noqa: E402

PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"  # 8 prompts, a shared 32-token prefix


def _prompt(i: int) -> tuple[int, ...]:
    return tuple(json.loads(PROMPTS.read_text().splitlines()[i])["prompt"])


def _rows(path) -> list[tuple[str, dict, int, int, str]]:
    with TraceReader(path) as r:
        t = r.requests
        return [
            (t.key[i], tag_of(t.params[i]), int(t.cached_tokens[i]), int(t.n_tokens[i]), t.status[i])
            for i in range(len(t))
        ]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "bf16.log"
    with start_engine(["--threads", "1", "--slots", "4", "--dtype", "bf16"], log_path=str(log)) as eng:
        yield eng


def test_priming_changes_only_the_token_at_the_boundary():
    p = _prompt(0)
    q = priming(p, 32)
    assert len(q) == len(p) and q[:32] == list(p[:32]) and q[32] != p[32] and q[33:] == list(p[33:])


def test_every_variant_is_a_tagged_row_with_the_boundary_it_asked_for(bf16, tmp_path):
    """Per repeat: alone:cold (flushed: reuses 0 even after a warm burst), warm:32 (primed:
    reuses exactly 32), burst (primed, target + its mate at once). Primes and mates are rows
    too. Each row says what it is; the target's rows stop at position t."""
    c0, c1 = _prompt(0), _prompt(1)
    tg = Target("c0", c0, 3, 1, 2, 0, 32, (5, 6, 7, 1), (Mate("c1", c1, 32, 6),), True, (1, 0))
    s = run_variants(VariantConfig(bf16.url, str(tmp_path / "v.h5"), repeats=2, top_logprobs=5), [tg])
    assert s.cache["available"] and s.cache["route"] == "/reset_prefix_cache" and s.notes == []
    rows = _rows(tmp_path / "v.h5")
    assert s.rows == len(rows) == 2 * 6 and s.counts["ok"] == 12
    by = {}
    for key, tag, cached, n, status in rows:
        assert status == "ok" and tag["config"] == "engine" and tag["target"] == "c0"
        by.setdefault((tag["variant"], tag["role"]), []).append((key, cached, n, tag["repeat"]))
    assert by[("alone:cold", "target")] == [("c0@alone:cold#r0", 0, 4, 0), ("c0@alone:cold#r1", 0, 4, 1)]
    assert by[("warm:32", "target")] == [("c0@warm:32#r0", 32, 4, 0), ("c0@warm:32#r1", 32, 4, 1)]
    assert [k for k, *_ in by[("warm:32", "prime")]] == ["c0@warm:32/prime:32#r0", "c0@warm:32/prime:32#r1"]
    # the burst: one prime (c0 and c1 share the 32-token prefix), then both at once, each reusing 32
    assert [(k, c) for k, c, *_ in by[("burst", "target")]] == [("c0@burst#r0", 32), ("c0@burst#r1", 32)]
    assert [(k, c, n) for k, c, n, _ in by[("burst", "mate")]] == [
        ("c1@burst[c0]#r0", 32, 6),
        ("c1@burst[c0]#r1", 32, 6),
    ]
    assert len(by[("burst", "prime")]) == 2 and all(n == 1 for _, _, n, _ in by[("burst", "prime")])
    with TraceReader(tmp_path / "v.h5") as r:
        assert r.meta.run["explain"]["cache_flush"]["route"] == "/reset_prefix_cache"
        assert r.meta.run["explain"]["config"] == "engine"


def test_an_engine_without_a_flush_runs_alone_and_says_cold_is_unavailable(tmp_path):
    """vLLM without VLLM_SERVER_DEV_MODE answers 404 on /reset_prefix_cache (as this replay
    server does for every route it has no transcript of): the cold variant is unavailable,
    said in the summary and the trace, and the alone runs are labelled `alone`."""
    tg = Target("k", (5, 6, 7, 8), 0, 1, 2, 0, 0, (1,), (), True)
    with ReplayServer(routes_for("vllm")) as srv:
        s = run_variants(VariantConfig(srv.url, str(tmp_path / "v.h5"), repeats=2, top_logprobs=5), [tg])
        paths = [r["path"] for r in srv.requests]
    assert not s.cache["available"]
    assert "POST /reset_prefix_cache: HTTP 404" in s.cache["reason"] and "VLLM_SERVER_DEV_MODE=1" in s.cache["reason"]
    assert s.notes[0].startswith(f"cold variant unavailable on {srv.url}")
    assert [k for k, *_ in _rows(tmp_path / "v.h5")] == ["k@alone#r0", "k@alone#r1"]
    assert paths.count("/reset_prefix_cache") == 1  # tried once, never again


def _capture(url, out, **kw):
    cfg = CaptureConfig(url=url, prompts=str(PROMPTS), out=str(out), top_logprobs=5, progress=False, **kw)
    s = run_capture(cfg)
    assert s.counts["ok"] == 8
    return str(out)


@pytest.fixture(scope="module")
def fault_pair(tmp_path_factory):
    """A = the clean FP32 engine, serial; B = the same on an engine whose prefix cache serves
    the wrong block (`--inject-fault corrupt-prefix-cache`): the 7 prompts that reuse the
    shared 32-token prefix diverge. Yields (A, B, faulty engine)."""
    d = tmp_path_factory.mktemp("fault")
    with start_engine(["--threads", "1", "--slots", "4"], log_path=str(d / "clean.log")) as clean:
        a = _capture(clean.url, d / "a.h5", max_tokens=8)
    args = ["--threads", "1", "--slots", "4", "--inject-fault", "corrupt-prefix-cache"]
    with start_engine(args, log_path=str(d / "fault.log")) as bad:
        b = _capture(bad.url, d / "b.h5", max_tokens=8)
        yield a, b, bad


def _explain(*args, **kw):
    cmd = [sys.executable, "-m", "tracekit", "explain", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, **kw)


def test_the_injected_fault_is_not_reproduced_by_any_numeric_variant(fault_pair, tmp_path):
    a, b, bad = fault_pair
    out = _explain(a, b, "--url", bad.url, "--repeats", "2", "--out", tmp_path / "ex", "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "tracekit.explain/1" and len(doc["pairs"]) >= 1
    for p in doc["pairs"]:
        assert p["kind"] == "bug", p
        assert "not reproduced by any numeric variant — report as a bug" in p["cause"]
        cold = next(v for v in p["variants"] if v["variant"] == "alone:cold")
        assert cold["n"] == 2 and cold["b_numeric"] == 0
    assert (tmp_path / "ex" / "explain.json").is_file() and (tmp_path / "ex" / "variants-engine.h5").is_file()


def test_sigkill_keeps_every_finished_group(fault_pair, tmp_path):
    """explain writes through the capture's TraceWriter: killed mid-run, its variants trace
    opens (rebuilt from the journal) with every row written before the kill."""
    a, b, bad = fault_pair
    path = tmp_path / "ex" / "variants-engine.h5"
    cmd = [
        sys.executable,
        "-m",
        "tracekit",
        "explain",
        a,
        b,
        "--url",
        bad.url,
        "--repeats",
        "200",
        "--out",
        str(tmp_path / "ex"),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, deadline = 0, time.monotonic() + 600  # the deadline only turns a hang into a failure
    try:
        while seen < 10:
            assert proc.poll() is None and time.monotonic() < deadline, "explain ended or hung before 10 rows"
            if path.exists():
                try:
                    with TraceReader(path) as r:  # a live reader while the writer runs
                        seen = len(r)
                except TracekitError:  # the file is being created: look again
                    pass
            time.sleep(0.05)  # a poll interval, not a wait that must be long enough
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    rows = _rows(path)
    assert len(rows) >= seen and all(tag is not None and tag["config"] == "engine" for _, tag, *_ in rows)


def test_run_directory_form(fault_pair, tmp_path):
    """`tracekit explain RUN_DIR`: every cell whose diff has divergent pairs, its serial
    baseline as A and its burst as B (read through tracekit.rundir); traces under the cell."""
    import shutil

    from tracekit.analyze import diff
    from tracekit.rundir import Cell, CellRecord, RunDir

    a, b, bad = fault_pair
    rd = RunDir.create(tmp_path / "run", "name = 'x'\n")
    cell = Cell("ref", "fp32", True, "prefix8", 8, 4)
    serial, burst = rd.serial_rel(cell.group_id), rd.burst_rel(cell.id)
    for src, rel in ((a, serial), (b, burst)):
        rd.path(rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, rd.path(rel))
    ref = rd.write_diff(cell.id, diff(rd.path(serial), rd.path(burst)).to_json(), serial, burst)
    rd.write_cell(CellRecord(cell, serial, burst, (), ref))
    out = _explain(tmp_path / "run", "--url", bad.url, "--repeats", "1", "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "tracekit.explain-run/1" and [c["cell"] for c in doc["cells"]] == [cell.id]
    assert doc["cells"][0]["pairs"] and all(p["kind"] == "bug" for p in doc["cells"][0]["pairs"])
    assert (tmp_path / "run" / "cells" / cell.id / "explain" / "variants-engine.h5").is_file()


def test_the_traces_line_lists_only_what_was_written(fault_pair, tmp_path):
    """Without --teacher-forced there is no teacher.h5, and the closing line must not name one
    (issue 24 item 17)."""
    a, b, bad = fault_pair
    out = _explain(a, b, "--url", bad.url, "--repeats", "1", "--out", tmp_path / "ex")
    assert out.returncode == 1, out.stderr + out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("traces: "))
    assert not (tmp_path / "ex" / "teacher.h5").exists() and "teacher.h5" not in line
    listed = line.split("(", 1)[1].rstrip(")").split(", ")
    assert "explain.json" in listed and "variants-engine.h5" in listed
    assert all((tmp_path / "ex" / name).is_file() for name in listed)
