"""End to end against the reference engine (`tracekit serve`, FP32, tiny model)
on 127.0.0.1:0: serial and concurrent captures of the same prompt set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"


@pytest.fixture(scope="module")
def engine():
    with start_engine(["--threads", "1", "--slots", "4", "--dtype", "fp32"]) as eng:
        yield eng


def _capture(url: str, out: Path, concurrency: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tracekit",
            "capture",
            "--http",
            url,
            "--prompts",
            str(PROMPTS),
            "--out",
            str(out),
            "--concurrency",
            str(concurrency),
            "--ignore-eos",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.slow
def test_serial_and_concurrent_captures_agree_in_fp32(engine, tmp_path):
    """Keys, token ids, top-k, raw logits, cached_tokens and timings are all present, and
    in FP32 batching does not change a single token (diff says identical)."""
    runs = {}
    for name, c in (("serial", 1), ("concurrent", 8)):
        p = _capture(engine.url, tmp_path / f"{name}.h5", c)
        assert p.returncode == 0, p.stderr
        summary = json.loads(p.stdout)
        assert summary["counts"]["ok"] == sum(1 for _ in PROMPTS.open())
        lat = summary["latency"]
        assert 0 < lat["ttft_s"]["p50"] <= lat["e2e_s"]["p50"] and lat["itl_s"]["p99"] > 0
        runs[name] = tmp_path / f"{name}.h5"
    with TraceReader(runs["serial"]) as a, TraceReader(runs["concurrent"]) as b:
        run = a.meta.run
        assert run["dialect"] == "vllm" and "tracekit" in run["dialect_reason"]
        assert run["engine"]["v1_models"]["meta"]["engine"] == "tracekit" and run["eos_token_ids"] == [0]
        assert a.layout.topk == 20 and a.layout.raw_logits
        # The engine reports its dtype: the classifier's grid comes from the run's `dtype`.
        assert (run["dtype"], run["dtype_source"]) == ("fp32", "engine: /v1/models meta.dtype")
        assert run["logprobs_mode"] == "raw_logprobs" and run["sampling"]["max_tokens"] == 32
        # The reference engine gives every piece of evidence: no pitfall (capture/pitfalls.py).
        assert run["pitfalls"] == [] and b.meta.run["pitfalls"] == []
        # The engine's /metrics counters around each capture, which alone used the engine: its hit
        # counter moved by the requests' cached tokens, its query counter by their prompt tokens.
        for t in (a, b):
            c = t.meta.run["prefix_cache_counters"]
            assert (c["family"], c["hits"]) == ("tracekit", "tracekit:prefix_cache_hits_total")
            assert (
                c["hits_delta"] == t.requests.cached_tokens.sum() and c["queries_delta"] == t.requests.prompt_len.sum()
            )
        assert b.meta.run["concurrency"] == 8
        ia, ib = a.requests.index_by_key(), b.requests.index_by_key()
        assert set(ia) == set(ib) and len(ia) >= 8
        # The shared-prefix prompts hit the prefix cache in at least one run.
        assert (a.requests.cached_tokens > 0).any() or (b.requests.cached_tokens > 0).any()
        assert (a.requests.cached_tokens >= 0).all()
        for k in ia:
            ra, rb = a.record(ia[k]), b.record(ib[k])
            ta, tb = a.tokens(ia[k]), b.tokens(ib[k])
            assert ra.status == rb.status == "ok" and len(ta) == len(tb) == 32
            assert ra.prompt_len > 0 and np.array_equal(a.prompt_ids(ia[k]), b.prompt_ids(ib[k]))
            assert np.array_equal(ta.token_id, tb.token_id)
            assert (ta.topk_id >= 0).all() and np.isfinite(ta.topk_logprob).all() and np.isfinite(ta.topk_logit).all()
            assert (ta.topk_id[:, 0] == ta.token_id).all()  # greedy: the chosen token is the top-1
            np.testing.assert_allclose(ta.logprob, tb.logprob, atol=1e-4)
            for r, t in ((ra, ta), (rb, tb)):
                assert r.t_sent_s < r.t_first_token_s <= r.t_done_s
                assert np.all(np.diff(t.t_arrival_s) >= 0) and t.t_arrival_s[-1] <= r.t_done_s
    d = subprocess.run(
        [sys.executable, "-m", "tracekit", "diff", str(runs["serial"]), str(runs["concurrent"]), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if d.returncode == 2 and "No such command" in d.stderr:
        pytest.skip("tracekit diff not available")
    summary = json.loads(d.stdout)["summary"]
    assert summary["identical"] == summary["pairs"] == len(ia), summary


@pytest.mark.slow
def test_repeats_and_poisson_arrivals(engine, tmp_path):
    """--repeat K makes keys id#r<k>; Poisson arrivals spread the send times."""
    out = tmp_path / "rep.h5"
    p = _capture(engine.url, out, 4, "--repeat", "2", "--arrival", "poisson:40", "--no-stream")
    assert p.returncode == 0, p.stderr
    with TraceReader(out) as r:
        keys = set(r.requests.key)
        n = sum(1 for _ in PROMPTS.open())
        assert len(keys) == 2 * n and all("#r0" in k or "#r1" in k for k in keys)
        assert r.meta.run["arrival"] == {"poisson_rate_per_s": 40.0, "seed": 0}
        sent = np.sort(r.requests.t_sent_s)
        assert sent[-1] - sent[0] > 0.05  # not a burst
        # The prompt file's per-request max_tokens (32) wins over the command line's default.
        assert all(len(r.tokens(i)) == 32 for i in range(len(r)))
        a, b = r.requests.index_by_key()["c0#r0"], r.requests.index_by_key()["c0#r1"]
        assert np.array_equal(r.tokens(a).token_id, r.tokens(b).token_id)


@pytest.mark.slow
def test_api_key_against_the_engine(tmp_path):
    """The engine requires a key: without one the capture stops with a one-line error (exit 3);
    with --api-key-env it captures, and the key is nowhere in the file."""
    key = "tk-e2e-7c1f0a9d42SECRET"
    with start_engine(
        ["--threads", "1", "--slots", "2", "--api-key-env", "TK_E2E_KEY"], env=dict(os.environ, TK_E2E_KEY=key)
    ) as eng:
        p = _capture(eng.url, tmp_path / "nokey.h5", 2)
        assert p.returncode == 3 and "API key" in p.stderr and "Traceback" not in p.stderr
        out = tmp_path / "key.h5"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "tracekit",
                "capture",
                "--http",
                eng.url,
                "--prompts",
                str(PROMPTS),
                "--out",
                str(out),
                "--api-key-env",
                "TK_E2E_KEY",
                "--max-tokens",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT), TK_E2E_KEY=key),
        )
        assert p.returncode == 0, p.stderr
    assert key.encode() not in out.read_bytes() and b"SECRET" not in out.read_bytes()
