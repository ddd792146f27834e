"""A real `tracekit capture` against the reference engine, killed with SIGKILL, then resumed.

Each kill waits for an event (the capture's write-ahead journal holding k
requests), never for a clock. After the kill the file must open (in a
subprocess with a timeout) and hold every request the journal held; `--resume`
must complete the run with every key once, send exactly the missing ones, and
keep the kept rows bitwise. The full count (20 kills of capture, 5 of
`tracekit run`) is `bench/crash.py`; this is the CI sample, with its helpers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import load_file

ROOT = Path(__file__).resolve().parents[2]
crash = load_file("bench/crash.py", "crash")

from tracekit.engine.process import start_engine  # noqa: E402

REPEAT = 3
PLANNED = {f"c{p}#r{r}" for p in range(8) for r in range(REPEAT)}


@pytest.fixture(scope="module")
def engine():
    eng = start_engine(["--slots", "4", "--threads", "1"])
    yield eng
    eng.stop()


def kill_capture(engine, trace: Path, k: int, *extra: str) -> tuple[list[str], dict | None]:
    proc = subprocess.Popen(
        crash.capture_cmd(engine.url, trace, REPEAT, *extra),
        env=crash.ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    durable, how = crash.kill_when(proc, trace, k, 0.0)
    assert how == "k rows", "the capture finished before the kill point"
    return durable, crash.check_killed(trace, durable, PLANNED)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1, 9, 19])
def test_killed_capture_keeps_durable_rows_and_resume_completes_it(engine, tmp_path, k):
    """k = 0 kills as soon as the writer has started (the file may not exist yet); later kills
    land while requests are in flight."""
    trace = tmp_path / "t.h5"
    durable, got = kill_capture(engine, trace, k)
    assert len(durable) >= k
    if k:
        assert got is not None and set(durable) <= set(got["keys"])
    res = crash.resume(engine.url, trace, REPEAT, PLANNED, got)
    assert res["kept"] + res["sent"] == len(PLANNED)


@pytest.mark.slow
def test_a_killed_resume_keeps_the_rows_it_was_copying(engine, tmp_path):
    """The state a --resume leaves when killed right after its first step (os.replace(out,
    out.resume-prev)), built without a clock: the next --resume must still keep those rows."""
    trace = tmp_path / "t.h5"
    _, got = kill_capture(engine, trace, 6)
    kept = set(got["keys"])
    trace.rename(trace.with_name(trace.name + ".resume-prev"))  # what http._resume_source does first
    r = subprocess.run(
        crash.capture_cmd(engine.url, trace, REPEAT, "--resume", "--json"),
        capture_output=True,
        text=True,
        env=crash.ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["kept_from_resume"] >= len(kept), f"kept rows lost: {len(kept)} before, {s['kept_from_resume']} kept"
