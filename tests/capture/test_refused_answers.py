"""One answer the trace cannot hold never stops a capture (capture/postprocess.py: storable).

The store's writer refuses what its reader could not read back (tracekit.store.check_request),
and refuses a whole group for one such row; a capture that handed it an engine's finish reason
over 16 bytes, or error text with a lone surrogate, used to stop with exit 3 and lose the run.
Now each answer is checked first and a refused one is an `error` row that says why, with as
much of the answer as the trace can hold. Real sockets (the replay server), real HDF5 files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.capture_helpers import write_prompts
from support.replay import ReplayServer, routes_for

from tracekit.capture.client import Outcome
from tracekit.capture.postprocess import storable
from tracekit.schema import Layout, RequestRecord
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    {"id": "a", "prompt": "x"},
    {"id": "long", "prompt": "FAULT:badfinish"},
    {"id": "surrogate", "prompt": "FAULT:surrogate"},
    {"id": "b", "prompt": "y"},
]


def _rows(out) -> dict:
    with TraceReader(out) as r:
        return {r.requests.key[i]: (r.record(i), len(r.tokens(i))) for i in range(len(r))}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_a_refused_answer_is_an_error_row_and_the_run_goes_on(capture_to, stream):
    prompts = PROMPTS if stream else [p for p in PROMPTS if p["id"] != "surrogate"]  # an SSE error event
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, prompts, concurrency=2, stream=stream)
    rows = _rows(out)
    assert sorted(rows) == sorted(p["id"] for p in prompts)
    assert s.counts["ok"] == 2 and s.counts["error"] == len(prompts) - 2
    assert all(rows[k][0].status == "ok" and rows[k][0].finish_reason == "length" for k in ("a", "b"))
    long, n = rows["long"]
    # The tokens stay as evidence; only the finish reason the column cannot hold is dropped, and named.
    assert long.status == "error" and n == 12 and long.finish_reason == ""
    assert "finish_reason 'length_été_reached_here' is not ASCII" in long.error
    if stream:
        bad, _ = rows["surrogate"]
        assert bad.status == "error" and "bad \\ud800 byte" in bad.error and "not valid Unicode" in bad.error


def test_the_command_exits_1_not_3(tmp_path):
    """A failed request is exit 1 (its row is in the trace), never a tool error."""
    pfile = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    with ReplayServer(routes_for("vllm")) as srv:
        r = subprocess.run(
            [sys.executable, "-m", "tracekit", "capture", "--http", srv.url, "--prompts", pfile]
            + ["--out", str(tmp_path / "r.h5"), "--max-tokens", "12", "--top-logprobs", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "failed: long (error): " in r.stderr
    assert r.stdout.startswith(f"{tmp_path / 'r.h5'}: 2/4 ok, 2 error")


def test_ids_outside_int32_drop_the_tokens_and_prompt_ids_but_keep_the_row():
    """Prompt ids the engine echoed past int32 cannot be stored: the row stays, as an error
    without its prompt ids (prompt_len unknown), saying why."""
    rec = RequestRecord(key="k", prompt_hash="0" * 64, status="ok", prompt_len=2)
    row = storable(Outcome(rec, None, [5, 1 << 40]), Layout(topk=5))
    assert row.record.status == "error" and row.record.prompt_len == -1 and row.prompt_ids is None
    assert "prompt ids holds 5..1099511627776, outside" in row.record.error
