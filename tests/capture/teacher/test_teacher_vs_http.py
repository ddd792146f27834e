"""The diagnostic against the reference engine: same tokens, same logprobs.

A real `tracekit serve` (FP32, fixture model, prefix cache on) on 127.0.0.1:0,
a real `tracekit capture --http`, then `tracekit capture --teacher-forced
--from` on that trace. The `full` history must reproduce the engine's FP32
logprobs for the same tokens to ~1e-4 (and prefix:auto, which replays the
engine's reported cache boundary, likewise): if it did not, the diagnostic
could not be used as evidence about the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"

pytestmark = pytest.mark.slow


def _tracekit(*args):
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2"),
    )


def test_full_fp32_matches_the_engines_http_logprobs(fixture_model_dir, tmp_path):
    http, diag = tmp_path / "http.h5", tmp_path / "diag.h5"
    with start_engine(["--model", fixture_model_dir, "--threads", "1", "--slots", "4", "--dtype", "fp32"]) as eng:
        r = _tracekit(
            "capture",
            "--http",
            eng.url,
            "--prompts",
            PROMPTS,
            "--out",
            http,
            "--max-tokens",
            16,
            "--top-logprobs",
            5,
            "--concurrency",
            1,
            "--json",
        )
    assert r.returncode == 0, r.stderr
    r = _tracekit(
        "capture",
        "--teacher-forced",
        fixture_model_dir,
        "--from",
        http,
        "--history",
        "full,prefix:auto",
        "--dtype",
        "fp32",
        "--top-logprobs",
        5,
        "--out",
        diag,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    with TraceReader(http) as h, TraceReader(diag) as d:
        ht, dt = h.requests, d.requests
        assert (ht.status == "ok").all() and len(ht) == 8
        assert (ht.cached_tokens > 0).any(), "the prompt set shares prefixes: the engine should report hits"
        compared, worst = {"full": 0, "prefix": 0}, 0.0
        for i in range(len(dt)):
            j = list(ht.key).index(dt.key[i])
            a, b = h.tokens(j), d.tokens(i)
            np.testing.assert_array_equal(b.token_id, a.token_id)  # the same tokens, teacher-forced
            np.testing.assert_allclose(b.logprob, a.logprob, atol=1e-4, err_msg=f"{dt.key[i]} {dt.history[i]}")
            np.testing.assert_allclose(b.topk_logprob, a.topk_logprob, atol=1e-4)
            worst = max(worst, float(np.abs(b.logprob - a.logprob).max()))
            compared["prefix" if dt.history[i].startswith("prefix:") else "full"] += 1
            if dt.history[i].startswith("prefix:"):
                assert dt.cached_tokens[i] == ht.cached_tokens[j] == int(dt.history[i].split(":")[1])
        print(f"max |dlogprob| diagnostic vs HTTP (FP32): {worst:.2e}")
        assert compared["full"] == 8 and compared["prefix"] == int((ht.cached_tokens > 0).sum())
