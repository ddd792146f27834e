"""--resume never loses a row it held (capture/resume.py), whatever moment killed the resume
before it. The states a kill leaves are built exactly (renames and a writer, as the resume does
them), without a clock: `.resume-prev` alone, `.resume-prev` beside the killed resume's empty
`<out>`, and `.resume-prev` beside an `<out>` that already holds rows sent after the copy.
Real sockets (the replay server), real HDF5 files; the SIGKILL version is
tests/capture/test_capture_crash.py and bench/crash.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.replay import ReplayServer, routes_for

from tracekit.errors import ConfigError
from tracekit.store import TraceReader, TraceWriter, copy_requests

PROMPTS = [{"id": k, "prompt": p} for k, p in (("a", "x"), ("b", "y"), ("c", "FAULT:500"), ("d", "FAULT:500"))]


def _rows(path) -> dict:
    """key -> (record, token columns, prompt ids) of every row."""
    with TraceReader(path) as r:
        return {r.requests.key[i]: (r.record(i), r.tokens(i), r.prompt_ids(i)) for i in range(len(r))}


def _same(x, y) -> bool:
    (ra, ta, pa), (rb, tb, pb) = x, y
    cols = ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob")
    return (
        ra == rb
        and all(np.array_equal(getattr(ta, c), getattr(tb, c), equal_nan=True) for c in cols)
        and np.array_equal(pa, pb)
    )


@pytest.fixture
def first_run(capture_to, tmp_path):
    """A run where c and d failed (HTTP 500): out holds a, b ok; also a whole run (every key ok)
    of the same configuration, whose rows stand for what a killed resume had sent."""
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, PROMPTS, name="r.h5")
        assert s.counts == {"ok": 2, "error": 2, "cancelled": 0, "timeout": 0}
        srv.armed = False
        _, whole = capture_to(srv.url, PROMPTS, name="whole.h5")
    return out, whole


def _resume(capture_to, out):
    with ReplayServer(routes_for("vllm")) as srv:
        srv.armed = False
        s, _ = capture_to(srv.url, PROMPTS, name=out.name, resume=True)
        return s, sorted(q["body"]["prompt"] for q in srv.requests)


def _killed_resume_out(out, source, keys: list[str]) -> None:
    """<out> as a resume killed after creating it left it: its own metadata, these rows of source."""
    with TraceReader(source) as r, TraceWriter(out, r.meta) as w:
        copy_requests(r, w, [r.requests.index_by_key()[k] for k in keys])


@pytest.mark.parametrize("out_holds", ["nothing", "empty", "kept rows", "a row sent after the copy"])
def test_a_killed_resume_loses_no_row(capture_to, first_run, out_holds):
    """The resume was killed after moving <out> to .resume-prev: with no <out> yet, with its new
    empty <out>, with the kept rows copied, or with a row it had sent since (c). The next resume
    keeps every one of those rows bitwise, sends only what no file held, and cleans up."""
    out, whole = first_run
    before = _rows(out)
    prev = out.with_name(out.name + ".resume-prev")
    out.rename(prev)
    extra = {"nothing": None, "empty": [], "kept rows": ["a", "b"], "a row sent after the copy": ["a", "b", "c"]}
    if extra[out_holds] is not None:
        _killed_resume_out(out, whole, extra[out_holds])
    s, sent = _resume(capture_to, out)
    after = _rows(out)
    assert sorted(after) == ["a", "b", "c", "d"] and {r.status for r, _, _ in after.values()} == {"ok"}
    assert all(_same(before[k], after[k]) for k in ("a", "b"))
    if out_holds == "a row sent after the copy":
        assert s.kept == 3 and sent == ["FAULT:500"] and _same(_rows(whole)["c"], after["c"])
    else:
        assert s.kept == 2 and sent == ["FAULT:500", "FAULT:500"]
    assert not prev.exists() and not out.with_name(out.name + ".resume-merge").exists()


def test_without_resume_a_left_resume_prev_is_refused(capture_to, first_run):
    """A killed resume's .resume-prev holds the run's rows: a plain capture to the same --out must
    not start next to it (a later --resume would mix the two runs)."""
    out, _ = first_run
    out.rename(out.with_name(out.name + ".resume-prev"))
    with ReplayServer(routes_for("vllm")) as srv, pytest.raises(ConfigError, match="a killed --resume left"):
        capture_to(srv.url, PROMPTS, name=out.name)


def test_the_resume_summary_counts_every_row_of_the_trace(first_run, tmp_path):
    """`capture --resume` prints (and --json says) what the trace holds, kept rows included:
    4/4 ok after a resume that kept 2 and sent 2, not "2/2 ok" (issue 24 item 17)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out, _ = first_run
    pfile = tmp_path / "r.h5.jsonl"  # the prompt set of the first run (a resume checks its sha256)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    def resume(url, *extra):
        argv = [sys.executable, "-m", "tracekit", "capture", "--http", url, "--prompts", str(pfile), "--out", str(out)]
        argv += ["--max-tokens", "12", "--top-logprobs", "5", "--resume", *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

    with ReplayServer(routes_for("vllm")) as srv:
        srv.armed = False
        p = resume(srv.url)
        q = resume(srv.url, "--json")  # nothing left to send: every row kept
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"{out}: 4/4 ok, 0 error, 0 timeout, 0 cancelled (2 kept from --resume, 2 sent now; ")
    with TraceReader(out) as r:
        assert len(r) == 4 and all(s == "ok" for s in r.requests.status)
    doc = json.loads(q.stdout)
    assert doc["kept_from_resume"] == 4 and doc["counts"]["ok"] == 0 and doc["trace_counts"]["ok"] == 4
