"""What a capture's run records and refuses: unknown ids warned and recorded, logits returned in
the logprob fields (vLLM --logprobs-mode) stored as logits, the run's dtype, the command line's
precedence over a prompt file, --resume only with the same configuration, and the one-line
errors of a bad prompt file. Real sockets (the replay server), real HDF5 files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.capture_helpers import TOKENIZER, sigint_default, wait_ok_rows, write_prompts
from support.replay import ReplayServer, Transcript, load, routes_for

from tracekit.errors import ConfigError
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]
_VLLM = json.loads(load("vllm__v1-completions__nonstream.http").body)["choices"][0]["logprobs"]


def _json_route(path: str, doc: dict) -> Transcript:
    return Transcript("GET", path, b"", 200, {"content-type": "application/json"}, json.dumps(doc).encode())


def test_unknown_ids_are_warned_once_and_recorded(capture_to, capsys):
    """A strings-only engine and no --tokenizer: every id is -1. The capture says so once on
    stderr with the fix, the run metadata records that strings cannot be mapped, the summary counts
    the tokens, and each row's error says why (status stays ok)."""
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}], concurrency=2)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: the engine sent token strings")]
    assert len(warnings) == 1 and "--tokenizer DIR" in warnings[0] and "--dialect vllm" in warnings[0]
    assert s.counts["ok"] == 2 and s.unknown_id_tokens == 24 and s.as_dict()["unknown_id_tokens"] == 24
    with TraceReader(out) as r:
        assert r.meta.run["token_ids_unmapped"] is True and "no --tokenizer" in r.meta.run["token_ids"]
        assert all((r.tokens(i).token_id == -1).all() and "pass --tokenizer" in r.record(i).error for i in range(2))


def test_with_a_tokenizer_the_same_engine_gets_ids_and_no_warning(capture_to, capsys):
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}], tokenizer=TOKENIZER)
    err = capsys.readouterr().err
    assert "token strings" not in err and "eos" not in err.lower() and s.unknown_id_tokens == 0
    with TraceReader(out) as r:
        assert r.meta.run["token_ids_unmapped"] is False and (r.tokens(0).token_id >= 0).all()


@pytest.mark.parametrize("how", ["option", "engine"])
def test_logits_in_the_logprob_fields_are_stored_as_logits(capture_to, how):
    """vLLM --logprobs-mode raw_logits: the values are logits. Given as an option or reported by
    the engine (/server_info in vLLM's dev mode), they fill topk_logit, in rank order; logprob and
    topk_logprob are unknown (NaN), never logits under a logprob name."""
    routes = routes_for("vllm")
    if how == "engine":
        cfg = {"model_config": {"dtype": "torch.bfloat16", "logprobs_mode": "raw_logits"}}
        routes[("GET", "/server_info")] = _json_route("/server_info", {"vllm_config": cfg})
    with ReplayServer(routes) as srv:
        s, out = capture_to(
            srv.url,
            [{"id": "a", "prompt": "x"}],
            stream=False,
            logprobs_mode="raw_logits" if how == "option" else "auto",
        )
    assert s.counts["ok"] == 1
    want = np.array([sorted(d.values(), reverse=True) for d in _VLLM["top_logprobs"]], np.float32)
    with TraceReader(out) as r:
        run, tok = r.meta.run, r.tokens(0)
        assert r.layout.raw_logits and run["logprobs_mode"] == "raw_logits"
        assert run["logprobs_mode_source"] == (
            "--logprobs-mode" if how == "option" else "engine: /server_info model_config.logprobs_mode"
        )
        np.testing.assert_array_equal(tok.topk_logit, want)
        assert np.isnan(tok.logprob).all() and np.isnan(tok.topk_logprob).all()
        assert tok.token_id.tolist() == [int(t[9:]) for t in _VLLM["tokens"]]
        if how == "engine":
            assert (run["dtype"], run["dtype_source"]) == ("bf16", "engine: /server_info model_config.dtype")


def test_the_run_records_its_dtype(capture_to):
    """`dtype` in the run metadata: the --dtype label when the engine does not say, null (and
    the source says how to fix it) when neither does; a label that contradicts the engine is an
    error before any file exists."""
    with ReplayServer(routes_for("vllm")) as srv:
        _, a = capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="a.h5", dtype="BF16")
        _, b = capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="b.h5")
    with TraceReader(a) as ra, TraceReader(b) as rb:
        assert (ra.meta.run["dtype"], ra.meta.run["dtype_source"]) == ("bf16", "--dtype")
        assert rb.meta.run["dtype"] is None and "--dtype" in rb.meta.run["dtype_source"]
    routes = routes_for("vllm")
    routes[("GET", "/server_info")] = _json_route(
        "/server_info", {"vllm_config": {"model_config": {"dtype": "float32"}}}
    )
    with ReplayServer(routes) as srv:
        with pytest.raises(ConfigError, match="--dtype bf16: the engine reports fp32"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="c.h5", dtype="bf16")
        with pytest.raises(ConfigError, match="expected one of fp32, bf16, fp16"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="d.h5", dtype="fp8")


def test_the_command_line_wins_over_the_prompt_file_and_says_so(capture_to, capsys):
    """A prompt's own max_tokens applies when --max-tokens is not given; given, --max-tokens wins
    for every request and stderr names the prompts it overrides."""
    prompts = [{"id": "a", "prompt": "x", "max_tokens": 4}, {"id": "b", "prompt": "y"}]
    with ReplayServer(routes_for("vllm")) as srv:
        _, out = capture_to(srv.url, prompts, name="own.h5", max_tokens=None)
        own = {q["body"]["prompt"]: q["body"]["max_tokens"] for q in srv.requests}
        assert "note:" not in capsys.readouterr().err
        srv.requests.clear()
        capture_to(srv.url, prompts, name="cli.h5", max_tokens=6)
        cli = {q["body"]["prompt"]: q["body"]["max_tokens"] for q in srv.requests}
    assert own == {"x": 4, "y": 32} and cli == {"x": 6, "y": 6}
    (note,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert "--max-tokens 6 applies to every request" in note and "1 prompt(s)" in note and "max_tokens 4" in note
    with TraceReader(out) as r:
        assert r.meta.run["sampling"]["max_tokens"] == [4, 32]  # what the requests asked, per prompt


@pytest.mark.parametrize(
    "change,part",
    [
        ({"concurrency": 2}, "concurrency 1 -> 2"),
        ({"max_tokens": 7}, "sampling"),
        ({"dialect": "openai"}, "dialect 'vllm' -> 'openai'"),
        ({"prompts": [{"id": "a", "prompt": "x"}, {"id": "z", "prompt": "other"}]}, "prompts.sha256"),
    ],
)
def test_resume_refuses_another_configuration(capture_to, tmp_path, change, part):
    """A resumed run must be the same run: another prompt set, dialect, sampling or concurrency is
    refused with the part named, and the trace is left as it was."""
    prompts = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "FAULT:500"}]
    with ReplayServer(routes_for("vllm")) as srv:
        capture_to(srv.url, prompts, name="r.h5")
        before = (tmp_path / "r.h5").read_bytes()
        kw = {k: v for k, v in change.items() if k != "prompts"}
        with pytest.raises(ConfigError, match="cannot --resume with another configuration") as e:
            capture_to(srv.url, change.get("prompts", prompts), name="r.h5", resume=True, **kw)
        assert part in str(e.value)
        assert (tmp_path / "r.h5").read_bytes() == before
        srv.armed = False
        s, out = capture_to(srv.url, prompts, name="r.h5", resume=True)  # the same run: completed
    assert s.kept == 1 and s.counts["ok"] == 1
    with TraceReader(out) as r:
        assert sorted(r.requests.key) == ["a", "b"] and set(r.requests.status) == {"ok"}


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", "capture", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.parametrize("mode", ["http", "teacher"])
def test_a_non_utf8_prompt_line_is_one_line_error(tmp_path, mode):
    """Latin-1 bytes in a prompt file: `Error: FILE:LINE: not UTF-8 ...`, exit 3, nothing on
    stdout, no traceback; for the HTTP capture and the teacher-forced diagnostic alike."""
    pf = tmp_path / "p.jsonl"
    pf.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    if mode == "http":
        p = _cli("--http", "http://127.0.0.1:9", "--prompts", pf, "--out", tmp_path / "o.h5")
    else:
        p = _cli("--teacher-forced", ROOT / "fixtures/models/tiny", "--prompts", pf, "--out", tmp_path / "o.h5")
    assert p.returncode == 3 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.startswith(f"Error: {pf}:2: not UTF-8 (byte 0xe9 at column 27)") and p.stderr.count("\n") == 1


def test_a_misspelled_field_is_named(tmp_path):
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "promt": "x"}])
    p = _cli("--http", "http://127.0.0.1:9", "--prompts", pf, "--out", tmp_path / "o.h5")
    assert p.returncode == 3 and "unknown field(s) ['promt'] (did you mean 'promt' -> 'prompt'?)" in p.stderr
    assert "must be a non-empty string" not in p.stderr


def test_ctrl_c_says_how_to_complete_the_run(tmp_path):
    """SIGINT once a request is written and another stalls: exit 130, and stderr gives the command
    with --resume that completes the run (not only "Aborted."). No step waits on timing: the
    stall lasts until the server stops, and SIGINT goes out once the trace holds the first row."""
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "s", "prompt": "FAULT:stall"}])
    out = tmp_path / "c.h5"
    with ReplayServer(routes_for("vllm")) as srv:
        args = ["--http", srv.url, "--prompts", pf, "--out", out, "--concurrency", "2", "--top-logprobs", "5"]
        p = subprocess.Popen(
            [sys.executable, "-m", "tracekit", "capture", *map(str, args)],
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
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"Interrupted: {out} keeps every finished request") and line.endswith("--resume")
    assert f"tracekit capture --http {srv.url}" in line and "Aborted." not in err


def test_an_engine_without_metrics_records_why(capture_to):
    """The engine's prefix-cache counters around the run (run.prefix_cache_counters): the replay
    server serves no /metrics, and the run says so instead of recording a 0."""
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}])
    with TraceReader(out) as r:
        c = r.meta.run["prefix_cache_counters"]
    assert c == {"family": None, "hits_delta": None, "queries_delta": None, "why": "the engine serves no /metrics"}
    assert s.as_dict()["prefix_cache_counters"] == c


def test_a_cold_capture_needs_a_working_reset_route_and_runs_one_at_a_time(capture_to, tmp_path):
    """The matrix's cold reference (CaptureConfig.reset_path): an engine that does not empty its
    prefix cache at the route stops the capture before any file exists; concurrency must be 1."""
    with pytest.raises(ConfigError, match="concurrency must be 1"):
        capture_to("http://127.0.0.1:9", [{"id": "a", "prompt": "x"}], concurrency=4, reset_path="/reset_prefix_cache")
    with ReplayServer(routes_for("vllm")) as srv:
        with pytest.raises(ConfigError, match=r"POST /reset_prefix_cache did not empty the prefix cache \(HTTP 500"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="cold.h5", reset_path="/reset_prefix_cache")
    assert not (tmp_path / "cold.h5").exists()
