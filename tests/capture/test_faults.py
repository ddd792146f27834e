"""Injected faults: each becomes the right row status, and the run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from capture_helpers import write_prompts
from replay import ReplayServer, routes_for

from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]
FAULTS = {  # prompt -> (status, http_status, error substring)
    "FAULT:500": ("error", 500, "injected failure"),
    "FAULT:cut": ("error", 200, "Payload"),
    "FAULT:cleancut": ("error", 200, "cut mid-event"),
    "FAULT:nodone": ("error", 200, "without [DONE]"),
    "FAULT:badjson": ("error", 200, "malformed JSON"),
    "FAULT:errorevent": ("error", 200, "injected engine error"),
    "FAULT:badshape": ("error", 200, "unexpected vllm response shape"),
    "FAULT:stall": ("timeout", 200, "timeout"),
    "FAULT:reset": ("error", 200, ""),
}


def _prompts():
    ps = [{"id": f"ok{i}", "prompt": "def parse_args(argv):\n    "} for i in range(4)]
    ps[2:2] = [{"id": f"f{i}", "prompt": p} for i, p in enumerate(FAULTS)]
    return ps


@pytest.mark.parametrize("concurrency", [1, 13])
def test_faults_in_a_burst(capture_to, concurrency):
    """A 500 in the middle of a burst, cut streams, bad JSON, an error event, a stall past
    the timeout and a connection reset: each is a row with its status; the others are ok."""
    with ReplayServer(routes_for("vllm"), stall_s=3.0) as srv:
        s, out = capture_to(srv.url, _prompts(), concurrency=concurrency, timeout_s=1.0)
    assert s.counts == {"ok": 4, "error": 8, "timeout": 1, "cancelled": 0}
    with TraceReader(out) as r:
        rows = {r.requests.key[i]: r.record(i) for i in range(len(r))}
        assert len(rows) == 13
        for i, (prompt, (status, http, msg)) in enumerate(FAULTS.items()):
            rec = rows[f"f{i}"]
            assert (rec.status, rec.http_status) == (status, http), (prompt, rec)
            assert msg in rec.error, (prompt, rec.error)
        for i in range(4):
            assert rows[f"ok{i}"].status == "ok" and rows[f"ok{i}"].output_len == 12


def test_no_final_event_is_an_error_without_done_marker(capture_to):
    """llama.cpp's /completion has no [DONE]: a stream without its `stop: true` event is cut."""
    with ReplayServer(routes_for("llamacpp")) as srv:
        s, out = capture_to(
            srv.url, [{"id": "x", "prompt": "FAULT:nodone"}, {"id": "y", "prompt": "fine"}], dialect="llamacpp"
        )
    with TraceReader(out) as r:
        rec = {r.requests.key[i]: r.record(i) for i in range(len(r))}
    assert rec["x"].status == "error" and "final event" in rec["x"].error
    assert rec["y"].status == "ok" and rec["y"].cached_tokens == 9


def test_resume_runs_exactly_the_failed_and_missing_keys(capture_to, tmp_path):
    with ReplayServer(routes_for("vllm")) as srv:
        prompts = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "FAULT:500"}, {"id": "c", "prompt": "y"}]
        s, out = capture_to(srv.url, prompts, name="r.h5")
        assert s.counts["error"] == 1
        srv.armed = False
        srv.requests.clear()
        prompts.append({"id": "d", "prompt": "z"})
        s2, out2 = capture_to(srv.url, prompts, name="r.h5", resume=True)
        assert sorted(q["body"]["prompt"] for q in srv.requests) == ["FAULT:500", "z"]
    assert s2.kept == 2 and s2.counts["ok"] == 2 and s2.failed == 0
    with TraceReader(out2) as r:
        assert sorted(r.requests.key) == ["a", "b", "c", "d"]
        assert set(r.requests.status) == {"ok"}
        assert all(len(r.tokens(i)) == 12 for i in range(4))
    assert not (tmp_path / "r.h5.resume-prev").exists()


def test_api_key_goes_out_as_bearer_and_never_into_the_file(tmp_path):
    """The key is read from the env var named on the command line; the trace's bytes never hold it."""
    key = "sk-test-3f9a1c7e5b2d4680SECRET"
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "FAULT:500"}])
    out = tmp_path / "k.h5"
    env = dict(os.environ, MY_KEY=key, PYTHONPATH=str(ROOT))
    with ReplayServer(routes_for("vllm")) as srv:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "tracekit",
                "capture",
                "--http",
                srv.url,
                "--prompts",
                pf,
                "--out",
                str(out),
                "--api-key-env",
                "MY_KEY",
                "--top-logprobs",
                "5",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        auths = {q["auth"] for q in srv.requests}
    assert auths == {f"Bearer {key}"}
    assert p.returncode == 1, p.stderr  # one request failed
    summary = json.loads(p.stdout)  # stdout: exactly one JSON document
    assert summary["counts"] == {"ok": 1, "error": 1, "timeout": 0, "cancelled": 0}
    data = out.read_bytes()
    assert key.encode() not in data and b"SECRET" not in data
    assert key not in p.stderr
    assert "failed: b (error): HTTP 500" in p.stderr and summary["failures"][0][:2] == ["b", "error"]


def test_interrupt_leaves_cancelled_rows(tmp_path):
    """SIGINT during a stall: in-flight requests become `cancelled` rows, finished ones stay."""
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "s", "prompt": "FAULT:stall"}])
    out = tmp_path / "c.h5"
    with ReplayServer(routes_for("vllm"), stall_s=3.0) as srv:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tracekit",
                "capture",
                "--http",
                srv.url,
                "--prompts",
                pf,
                "--out",
                str(out),
                "--concurrency",
                "2",
                "--top-logprobs",
                "5",
            ],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 30
        while len(srv.requests) < 2 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    with TraceReader(out) as r:
        st = {r.requests.key[i]: r.requests.status[i] for i in range(len(r))}
    assert st == {"a": "ok", "s": "cancelled"}


def test_sigkill_then_resume(tmp_path):
    """A capture killed with SIGKILL keeps every request it finished; --resume runs the rest."""
    prompts = [{"id": f"a{i}", "prompt": "x"} for i in range(3)] + [{"id": "s", "prompt": "FAULT:stall"}]
    pf = write_prompts(tmp_path / "p.jsonl", prompts)
    out = tmp_path / "k.h5"
    cmd = [
        sys.executable,
        "-m",
        "tracekit",
        "capture",
        "--http",
        "",
        "--prompts",
        pf,
        "--out",
        str(out),
        "--concurrency",
        "4",
        "--top-logprobs",
        "5",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with ReplayServer(routes_for("vllm"), stall_s=3.0) as srv:
        cmd[5] = srv.url
        p = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while len(srv.requests) < 4 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.7)  # the three quick requests complete and are flushed
        p.kill()
        p.wait(10)
        with TraceReader(out) as r:
            assert sorted(r.requests.key) == ["a0", "a1", "a2"] and set(r.requests.status) == {"ok"}
        srv.armed = False
        srv.requests.clear()
        q = subprocess.run(cmd + ["--resume", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert q.returncode == 0, q.stderr
        assert [x["body"]["prompt"] for x in srv.requests] == ["FAULT:stall"]
    with TraceReader(out) as r:
        assert sorted(r.requests.key) == ["a0", "a1", "a2", "s"] and set(r.requests.status) == {"ok"}
