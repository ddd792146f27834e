"""A short capture soak (bench/capture_soak.py's own code, 200 requests at concurrency 16): the
real `tracekit capture` command through the replay server, every fault kind of the server in 10
requests each. Every request must end as exactly one row with its kind's status, the `ok` rows
bitwise the transcript's answer, and the command must exit 1 (failed rows are in the trace).

Nothing here waits on the clock: the command runs to its end, the server counts what it saw.
The one timer is the capture's `--timeout-s`, which only the `stall` requests reach (the server
holds them until it stops); at 20 s it is a hang bound, not a guess at how fast a clean request
is (a few milliseconds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "capture_soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("tracekit_bench_capture_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_request_is_one_row_with_its_fault_s_status(tmp_path):
    """Faults before the first byte (retried: `ok` with 2 or 3 attempts; or, closed every time,
    an `error` after 3), mid-stream (`error` rows holding a prefix of the answer, never retried),
    refusals (`error` with their HTTP status), a stall (`timeout`), closed kept-alive connections
    and slow streams (`ok`): a capture that loses a row, writes one twice, retries an answer that
    had begun, or stores a wrong byte fails here."""
    soak = _soak_module()
    res = soak.soak(200, 16, seed=5, timeout_s=20.0, work=tmp_path)
    kinds = soak.plan(200, 5)
    assert res["kinds"] == {"clean": 40, **{k: 10 for k in soak.FAULTS}}

    # One row per key, with exactly its kind's status and HTTP status.
    assert (res["missing"], res["duplicates"], res["extra"]) == ([], [], [])
    assert res["rows"] == 200
    assert res["status_by_key"] == {k: (soak.KINDS[v].status, soak.KINDS[v].http) for k, v in kinds.items()}
    assert res["wrong_status"] == [], res["wrong_status"][:5]  # error text and attempts too
    assert res["wrong_tokens"] == [], res["wrong_tokens"][:5]  # ok rows bitwise, failed ones a prefix

    # The server saw `drop` twice, `dropall` 2-3 times (attempt 1 may die on a closed kept-alive
    # connection unseen), everything else once: no answer that had begun was sent again.
    assert res["wrong_sightings"] == [], res["wrong_sightings"][:5]
    assert 200 + 10 + 10 <= res["server_requests"] <= 200 + 10 + 20
    assert res["retried"] - res["retried_after_reuse"] == 20  # every drop and dropall row says so

    # The command ran to its end: exit 1 for the failed rows, its counts the trace's.
    assert res["exit_code"] == 1 and res["tracebacks"] == 0
    assert res["counts"] == {"ok": 70, "error": 120, "timeout": 10, "cancelled": 0}
    assert res["counts"] == res["counts_expected"] and res["counts_match_trace"]
