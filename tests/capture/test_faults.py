"""Injected faults: each becomes the right row status, and the run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.capture_helpers import sigint_default, wait_ok_rows, write_prompts
from support.replay import ReplayServer, routes_for

from tracekit.errors import TracekitError
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
    with ReplayServer(routes_for("vllm")) as srv:  # the stall lasts until the server stops
        s, out = capture_to(srv.url, _prompts(), concurrency=concurrency, timeout_s=5.0)
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
        with pytest.raises(TracekitError, match="prompts.sha256"):  # another prompt set: refused (issue 15)
            capture_to(srv.url, [*prompts, {"id": "d", "prompt": "z"}], name="r.h5", resume=True)
        s2, out2 = capture_to(srv.url, prompts, name="r.h5", resume=True)  # missing keys: test_sigkill_then_resume
        assert sorted(q["body"]["prompt"] for q in srv.requests) == ["FAULT:500"]
    assert s2.kept == 2 and s2.counts["ok"] == 1 and s2.failed == 0
    with TraceReader(out2) as r:
        assert sorted(r.requests.key) == ["a", "b", "c"]
        assert set(r.requests.status) == {"ok"}
        assert all(len(r.tokens(i)) == 12 for i in range(3))
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


def _capture_cmd(url: str, pf: str, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tracekit", "capture", "--http", url, "--prompts", pf, "--out", str(out)] + [
        "--top-logprobs",
        "5",
        *extra,
    ]


def test_interrupt_leaves_cancelled_rows(tmp_path):
    """SIGINT while one request stalls: in-flight requests become `cancelled` rows, finished ones
    stay. The stall lasts until the server stops, and SIGINT goes out only once the server holds
    the stalled request and the trace holds the finished one: no step depends on timing."""
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "s", "prompt": "FAULT:stall"}])
    out = tmp_path / "c.h5"
    with ReplayServer(routes_for("vllm")) as srv:
        p = subprocess.Popen(
            _capture_cmd(srv.url, pf, out, "--concurrency", "2"),
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=sigint_default,
        )
        srv.wait_requests(2)
        wait_ok_rows(out, p, {"a"})
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    with TraceReader(out) as r:
        st = {r.requests.key[i]: r.requests.status[i] for i in range(len(r))}
    assert st == {"a": "ok", "s": "cancelled"}


def test_sigkill_then_resume(tmp_path):
    """A capture killed with SIGKILL keeps every request it finished; --resume runs the rest."""
    prompts = [{"id": f"a{i}", "prompt": "x"} for i in range(3)] + [{"id": "s", "prompt": "FAULT:stall"}]
    pf = write_prompts(tmp_path / "p.jsonl", prompts)
    out = tmp_path / "k.h5"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with ReplayServer(routes_for("vllm")) as srv:
        cmd = _capture_cmd(srv.url, pf, out, "--concurrency", "4")
        p = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
        srv.wait_requests(4)
        wait_ok_rows(out, p, {"a0", "a1", "a2"})  # the three quick requests are flushed; "s" stalls
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


# ---- transport: no request lost to a kept-alive connection the server closed (issue 13) ----------


def _rows(out: Path) -> dict:
    with TraceReader(out) as r:
        return {r.requests.key[i]: r.record(i) for i in range(len(r))}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_no_request_lost_when_the_server_closes_kept_alive_connections(capture_to, monkeypatch, concurrency):
    """The server closes every kept-alive connection when the next request arrives on it, before
    any response byte. Without retries those requests are lost (first half); with them each is
    sent again on a fresh connection, and its row says so (second half)."""
    prompts = [{"id": f"p{i}", "prompt": "def parse_args(argv):\n    "} for i in range(12)]
    with ReplayServer(routes_for("vllm"), drop_kept_alive=True) as srv:
        monkeypatch.setattr("tracekit.capture.client.ATTEMPTS", 1)
        lost, out1 = capture_to(srv.url, prompts, name="no-retry.h5", concurrency=concurrency)
        monkeypatch.undo()
        dropped_before = srv.dropped
        s, out = capture_to(srv.url, prompts, name="retry.h5", concurrency=concurrency)
        dropped = srv.dropped - dropped_before
    assert lost.counts["error"] > 0 and lost.counts["ok"] + lost.counts["error"] == 12
    assert {r.error.split(":")[0] for r in _rows(out1).values() if r.status == "error"} == {"ServerDisconnectedError"}
    assert s.counts == {"ok": 12, "error": 0, "timeout": 0, "cancelled": 0}
    rows = _rows(out)
    retried = [r for r in rows.values() if r.error]
    assert retried and dropped >= len(retried)  # the probe's GETs were dropped too (and retried)
    for r in retried:
        assert r.error.startswith("2 attempts, the connection failed before any response byte; first: Server"), r.error
        assert r.status == "ok" and r.http_status == 200 and r.output_len == 12


def test_llamacpp_gets_a_new_connection_per_request(capture_to):
    """llama.cpp's server is captured without keep-alive (probe.KEEP_ALIVE): each request asks for
    `Connection: close`, so no request is ever written to a reused connection and none needs a retry,
    even from a server that drops every reused one."""
    prompts = [{"id": f"p{i}", "prompt": "def parse_args(argv):\n    "} for i in range(6)]
    with ReplayServer(routes_for("llamacpp"), drop_kept_alive=True) as srv:
        s, out = capture_to(srv.url, prompts, concurrency=2, dialect="auto")
        conns = srv.connections
    assert s.counts["ok"] == 6 and srv.dropped == 0
    assert all(c["requests"] == 1 and c["close"] == ["close"] for c in conns), conns
    assert not any(r.error for r in _rows(out).values())
    with TraceReader(out) as r:
        assert r.meta.run["engine"]["keep_alive"]["on"] is False


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_server_closing_after_each_response_loses_nothing(capture_to, engine):
    """A server that closes each connection right after its response while promising keep-alive
    (llama-server after a stream). Kept alive (vllm), a reuse may race the FIN: every request still
    ends ok, retried where it lost. Not kept alive (llamacpp, probe.KEEP_ALIVE): no connection is
    ever reused, so no request needs a retry at all."""
    prompts = [{"id": f"p{i}", "prompt": "def parse_args(argv):\n    "} for i in range(16)]
    with ReplayServer(routes_for(engine), close_after_response=True) as srv:
        for c in (1, 4):
            s, out = capture_to(srv.url, prompts, name=f"c{c}.h5", concurrency=c)
            assert s.counts["ok"] == 16, s.failures
            retried = [r.error for r in _rows(out).values() if "attempts" in r.error]
            if engine == "llamacpp":
                assert retried == []
        if engine == "llamacpp":
            assert all(c["requests"] == 1 for c in srv.connections), srv.connections


def test_failure_after_the_response_began_is_not_retried(capture_to):
    """A reset or a cut after the first bytes is the engine's answer: one attempt, an error row."""
    prompts = [{"id": "r", "prompt": "FAULT:reset"}, {"id": "c", "prompt": "FAULT:cut"}]
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, prompts, concurrency=2)
        n = len(srv.requests)
    assert n == 2 and s.counts["error"] == 2
    assert not any("attempts" in r.error for r in _rows(out).values())


# ---- probe: not ready, a URL with /v1, a wrong dialect (issue 13) ---------------------------------


def _probe(url: str, wait_ready_s: float):
    import asyncio

    from tracekit.capture.client import make_session
    from tracekit.capture.probe import probe

    async def go():
        async with make_session(1, 10.0) as session:
            return await probe(session, url, "auto", wait_ready_s=wait_ready_s)

    return asyncio.run(go())


def test_engine_loading_is_waited_for(capture_to):
    """An engine that answers 503 while it loads: --wait-ready waits for it; without it the
    message says the engine is not ready (never 'pass --dialect')."""
    from tracekit.errors import CaptureError

    with ReplayServer(routes_for("llamacpp"), not_ready=100) as srv:
        with pytest.raises(CaptureError, match="the engine is not ready .*HTTP 503.*Loading model.*--wait-ready"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}])
    with ReplayServer(routes_for("llamacpp"), not_ready=3) as srv:
        pr = _probe(srv.url, wait_ready_s=60.0)
        assert srv.answered_503 == 3 and pr.dialect == "llamacpp"
    with ReplayServer(routes_for("llamacpp"), not_ready=2) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}], wait_ready_s=60.0)
        assert srv.answered_503 == 2 and s.counts["ok"] == 1


def test_wait_ready_on_the_command_line(tmp_path):
    """`--wait-ready S` through the CLI; a 503 without it exits 3 with one line naming the option."""
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with ReplayServer(routes_for("llamacpp"), not_ready=1) as srv:
        q = subprocess.run(_capture_cmd(srv.url, pf, tmp_path / "n.h5"), env=env, capture_output=True, text=True)
        p = subprocess.run(
            _capture_cmd(srv.url, pf, tmp_path / "w.h5", "--wait-ready", "60", "--json"),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert q.returncode == 3 and q.stdout == "" and q.stderr.count("\n") == 1, q.stderr
    assert "the engine is not ready" in q.stderr and "--wait-ready" in q.stderr
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["counts"]["ok"] == 1


def test_url_with_v1_says_drop_it(capture_to):
    from tracekit.errors import ConfigError

    with ReplayServer(routes_for("vllm")) as srv:
        with pytest.raises(ConfigError, match=r"drop the trailing /v1 .*--http http://127\.0\.0\.1:\d+$"):
            capture_to(srv.url + "/v1", [{"id": "a", "prompt": "x"}])
        assert srv.requests == []


def test_wrong_dialect_is_named(capture_to, capsys):
    """--dialect llamacpp against a vLLM server: a warning at once, and every request is a 404 row."""
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}], dialect="llamacpp")
    err = capsys.readouterr().err
    assert "warning: --dialect llamacpp, but the server looks like vllm (/v1/models owned_by='vllm')" in err
    assert "the first request answered HTTP 404 on /completion" in err
    assert s.counts["error"] == 1 and _rows(out)["a"].http_status == 404
    with TraceReader(out) as r:
        assert r.meta.run["engine"]["warnings"] and r.meta.run["dialect"] == "llamacpp"


def test_all_404_at_first_says_the_dialect_looks_wrong(capture_to, capsys):
    """A server the probe takes for plain OpenAI without a chat route, captured with --dialect
    openai-chat: no probe warning (the dialects are compatible), but after the first 3 answers,
    all 404, one line says the dialect looks wrong. The run goes on and keeps every row."""
    prompts = [{"id": f"p{i}", "prompt": "x"} for i in range(5)]
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        s, out = capture_to(srv.url, prompts, dialect="openai-chat")
    err = capsys.readouterr().err
    with TraceReader(out) as r:  # the run's pitfalls (capture/pitfalls.py) aside, one warning
        pitfalls = {f"warning: {p['message']}" for p in r.meta.run["pitfalls"]}
    assert len([x for x in err.splitlines() if x.startswith("warning:") and x not in pitfalls]) == 1, err
    assert "the first 3 requests all answered HTTP 404 on /v1/chat/completions" in err
    assert "'openai-chat' looks wrong" in err
    assert s.counts["error"] == 5 and {r.http_status for r in _rows(out).values()} == {404}


def test_probe_get_retries_a_dropped_kept_alive_connection():
    """The probe's GETs survive a server that drops a reused connection (when the session keeps
    connections alive, as it does after the probe for most engines)."""
    import asyncio

    from tracekit.capture.client import make_session
    from tracekit.capture.probe import _get

    async def go(url):
        async with make_session(1, 10.0) as s:
            return [(await _get(s, url + "/v1/models"))[0] for _ in range(3)]

    with ReplayServer(routes_for("vllm"), drop_kept_alive=True) as srv:
        statuses = asyncio.run(go(srv.url))
        dropped = srv.dropped
    assert statuses == [200, 200, 200] and dropped >= 1
