"""Crash and resume: a real `tracekit capture` killed with SIGKILL at random moments.

Against the reference engine (`tracekit serve`, the fixture model), each kill:
  1. starts `tracekit capture` (8 prompts x --repeat, 32 tokens, concurrency 4),
  2. waits for an event, never a clock: the capture's write-ahead journal holding
     k requests (k drawn at random, 0 = the journal's first record), then a random
     jitter of up to 30 ms so the kill lands anywhere (mid-request, mid-write),
  3. SIGKILL; the keys the journal held at that moment were durable,
  4. opens the file (in a subprocess with a timeout: a hang fails, never stalls):
     it must open and hold every one of those keys, each once, status ok,
  5. `--resume`s it: the run must complete with every key once, send exactly the
     missing ones (counts = planned - kept), and keep the kept rows bitwise
     (record, every token column, prompt ids).
Every fourth kill also kills the first `--resume` (the same way) and resumes again.

`--run-kills N` also kills `tracekit run` (a one-cell matrix) N times, after its
first trace rows are durable: every trace file in the run directory must open
and hold the rows its journal held (`tracekit run` has no --resume).

Prints a table, or with --json one object. Example:
    python bench/crash.py --kills 20 --run-kills 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tracekit.engine.process import start_engine  # noqa: E402
from tracekit.store.journal import journal_path, read_journal  # noqa: E402

PROMPTS = ROOT / "fixtures/prompts/cpu_small.jsonl"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
POLL_S = 0.002  # how often the journal is looked at while waiting for k rows

VERIFY = r"""
import json, sys
from tracekit.store import TraceReader
with TraceReader(sys.argv[1]) as r:
    t = r.requests
    print(json.dumps({"keys": list(t.key), "status": list(t.status)}))
"""


def capture_cmd(url: str, out: Path, repeat: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tracekit", "capture", "--http", url, "--prompts", str(PROMPTS), "--out", str(out),
        "--max-tokens", "32", "--ignore-eos", "--top-logprobs", "5", "--concurrency", "4",
        "--repeat", str(repeat), *extra,
    ]  # fmt: skip


def journal_keys(trace: Path) -> list[str]:
    """Keys of every complete record of the trace's journal (empty when there is none yet)."""
    try:
        meta, items = read_journal(journal_path(trace))
    except (FileNotFoundError, ValueError, KeyError):
        return []
    return [rec.key for rec, _, _ in items] if meta else []


def kill_when(proc: subprocess.Popen, trace: Path, k: int, jitter_s: float) -> tuple[list[str], str]:
    """SIGKILL `proc` once its journal holds k requests (+ jitter); returns the keys durable at the
    kill and how the wait ended. k = 0: once the journal exists (the writer has started)."""
    how = "k rows"
    while True:
        keys = journal_keys(trace)
        started = journal_path(trace).exists()
        if (k == 0 and started) or (k > 0 and len(keys) >= k):
            break
        if proc.poll() is not None:
            how = "exited first"
            break
        time.sleep(POLL_S)
    if proc.poll() is None and jitter_s > 0:
        time.sleep(jitter_s)
    durable = journal_keys(trace)  # read before the kill: all of these were flushed
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return durable, how


def read_trace(path: Path) -> dict | None:
    """Keys and statuses of a trace, opened in a subprocess with a timeout (None: no file)."""
    if not path.exists():
        return None
    r = subprocess.run(
        [sys.executable, "-c", VERIFY, str(path)], capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT
    )
    if r.returncode != 0:
        raise AssertionError(f"{path}: does not open after the kill: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def rows_by_key(path: Path) -> dict:
    """key -> (record fields, token column bytes, prompt id bytes): what 'bitwise the same' compares."""
    from tracekit.store import TraceReader

    out = {}
    with TraceReader(path) as r:
        for i in range(len(r)):
            rec = r.record(i)
            t = r.tokens(i)
            cols = tuple(
                None if getattr(t, c) is None else np.ascontiguousarray(getattr(t, c)).tobytes()
                for c in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit")
            )
            p = r.prompt_ids(i)
            out[rec.key] = (repr(rec), cols, None if p is None else p.tobytes())
    return out


def check_killed(trace: Path, durable: list[str], planned: set[str]) -> dict | None:
    got = read_trace(trace)
    if got is None:
        assert not durable, f"{trace}: no file, but the journal held {durable}"
        return None
    keys = got["keys"]
    assert len(keys) == len(set(keys)), f"{trace}: a key twice: {keys}"
    missing = set(durable) - set(keys)
    assert not missing, f"{trace}: lost durable requests {sorted(missing)}"
    assert set(keys) <= planned and set(got["status"]) <= {"ok"}, got
    # A journal left beside a file that opened is stale: the kill landed in the writer's close,
    # after the file was whole and closed (recovery would have replaced it and removed the journal).
    got["stale_journal"] = journal_path(trace).exists()
    return got


def resume(url: str, trace: Path, repeat: int, planned: set[str], before: dict | None) -> dict:
    """Run --resume to completion and check it: every key once, only the missing ones sent,
    kept rows bitwise the same."""
    kept_rows = rows_by_key(trace) if before is not None else {}
    r = subprocess.run(
        capture_cmd(url, trace, repeat, "--resume", "--json"), capture_output=True, text=True, env=ENV, timeout=600
    )
    assert r.returncode == 0, f"--resume failed ({r.returncode}): {r.stderr.strip()[-800:]}"
    s = json.loads(r.stdout)
    final = rows_by_key(trace)
    assert set(final) == planned and len(final) == len(planned), f"final keys {sorted(set(planned) - set(final))}"
    assert s["kept_from_resume"] == len(kept_rows), (s["kept_from_resume"], len(kept_rows))
    sent = sum(s["counts"].values())
    assert sent == len(planned) - len(kept_rows), f"sent {sent}, missing were {len(planned) - len(kept_rows)}"
    changed = [k for k, v in kept_rows.items() if final[k] != v]
    assert not changed, f"kept rows changed by --resume: {changed}"
    left = [p.name for p in trace.parent.glob(trace.name + ".*")]
    assert not left, f"files left beside the trace: {left}"
    return {"kept": len(kept_rows), "sent": sent}


def one_kill(url: str, d: Path, i: int, rng: np.random.Generator, repeat: int, twice: bool) -> dict:
    trace = d / f"kill{i:02d}.h5"
    # the capture's keys: the prompt id, with #r<k> only when it repeats (http.py plan_requests)
    planned = {f"c{p}#r{r}" if repeat > 1 else f"c{p}" for p in range(8) for r in range(repeat)}
    k = int(rng.integers(0, len(planned) - 4))
    jitter = float(rng.uniform(0, 0.03))
    t0 = time.perf_counter()
    proc = subprocess.Popen(capture_cmd(url, trace, repeat), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    durable, how = kill_when(proc, trace, k, jitter)
    got = check_killed(trace, durable, planned)
    row = {"kill": i, "wait_rows": k, "jitter_ms": round(jitter * 1e3, 1), "wait": how, "durable": len(durable)}
    row["in_file"] = 0 if got is None else len(got["keys"])
    row["stale_journal"] = bool(got and got["stale_journal"])
    if twice and got is not None:  # kill the resume as well (k2 = 0: as soon as its writer starts), resume again
        k2 = int(rng.integers(0, len(planned) - 2))
        proc = subprocess.Popen(
            capture_cmd(url, trace, repeat, "--resume"), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        durable2, _ = kill_when(proc, trace, k2, float(rng.uniform(0, 0.03)))
        got = check_killed(trace, sorted(set(got["keys"]) | set(durable2)), planned)
        row["resume_killed_at"] = k2
        row["resume_killed_in_file"] = 0 if got is None else len(got["keys"])
    row.update(resume(url, trace, repeat, planned, got))
    row["s"] = round(time.perf_counter() - t0, 2)
    return row


MATRIX = """
name = "crash"
[run]
ignore_eos = true
top_logprobs = 5
timeout_s = 120
ready_timeout_s = 120
[[prompts]]
name = "cpu_small"
path = "{prompts}"
[axes]
concurrency = [4]
dtype = ["fp32"]
prefix_cache = [true]
output_tokens = [32]
[[target]]
name = "ref"
serve = ["--threads", "1", "--slots", "4"]
"""


def one_run_kill(d: Path, i: int, rng: np.random.Generator) -> dict:
    """Kill `tracekit run` once a trace of its cell holds k rows; every trace must open whole.
    A run that finishes before its k-th row was seen is started again (with a new k)."""
    matrix = d / f"run{i}.toml"
    matrix.write_text(MATRIX.format(prompts=PROMPTS))
    for attempt in range(5):
        out = d / f"run{i}-{attempt}"
        k = int(rng.integers(1, 6))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tracekit", "run", str(matrix), "--out", str(out)],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the run and its engine form one process group, killed together
        )
        durable: dict[Path, list[str]] = {}
        while proc.poll() is None:
            journals = list(out.rglob("*.h5.journal")) if out.exists() else []
            durable = {j: journal_keys(Path(str(j)[: -len(".journal")])) for j in journals}
            if any(len(v) >= k for v in durable.values()):
                break
            time.sleep(POLL_S)
        time.sleep(float(rng.uniform(0, 0.03)))
        durable = {j: journal_keys(Path(str(j)[: -len(".journal")])) for j in durable}  # just before the kill
        if proc.poll() is not None:
            continue  # finished (or failed) before the kill: not a kill, try again
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        traces = sorted(out.rglob("*.h5"))
        held = 0
        for t in traces:
            got = read_trace(t)
            lost = set(durable.get(Path(str(t) + ".journal"), [])) - set(got["keys"])
            assert not lost, f"{t}: lost {sorted(lost)}"
            held += len(got["keys"])
        durable_n = sum(len(v) for v in durable.values())
        return {"run_kill": i, "wait_rows": k, "traces": len(traces), "durable": durable_n, "rows_held": held}
    raise AssertionError(f"run kill {i}: `tracekit run` finished before every one of 5 kill points")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Example: python bench/crash.py --json")
    ap.add_argument("--kills", type=int, default=20, help="kills of `tracekit capture` (each then resumed)")
    ap.add_argument("--run-kills", type=int, default=5, help="kills of `tracekit run`")
    ap.add_argument("--repeat", type=int, default=5, help="--repeat of the capture: 8 x R requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    rows, run_rows, failures = [], [], []
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        eng = start_engine(["--slots", "4", "--threads", "1"])
        try:
            for i in range(a.kills):
                try:
                    rows.append(one_kill(eng.url, d, i, rng, a.repeat, twice=i % 4 == 3))
                except AssertionError as e:
                    failures.append(f"kill {i}: {e}")
        finally:
            eng.stop()
        for i in range(a.run_kills):
            try:
                run_rows.append(one_run_kill(d, i, rng))
            except AssertionError as e:
                failures.append(f"run kill {i}: {e}")
        shutil.rmtree(d, ignore_errors=True)
    res = {
        "capture_kills": a.kills,
        "capture_survived": len(rows),
        "resume_kills": sum(1 for r in rows if "resume_killed_in_file" in r),
        "run_kills": a.run_kills,
        "run_survived": len(run_rows),
        "durable_rows_lost": 0 if not failures else None,
        "failures": failures,
        "kills": rows,
        "runs": run_rows,
    }
    if a.json:
        print(json.dumps(res))
    else:
        for r in rows + run_rows:
            print(r)
        print(f"capture: {len(rows)}/{a.kills} kills survived and resumed; run: {len(run_rows)}/{a.run_kills}")
        for f in failures:
            print("FAILED", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
