"""The graded fault `perturb-kv:EPS`: reused prefix-cache blocks served scaled by 1 + EPS * noise.

bench/sensitivity.py measures the smallest EPS that `tracekit diff` flags; that measurement is
only worth something if the fault does exactly what it says: nothing at EPS = 0 (bitwise), a
real change to the logits after a hit, the same noise for the same block every time, and an
honest log of how many KV values it changed.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
from support.engine_helpers import greedy, run_serial

from tracekit.engine.faults import Fault, parse_fault, prompt_ids_sha256
from tracekit.errors import ConfigError


def _pair(tag: bytes) -> list[dict]:
    """Two requests sharing a 3-block header (48 token ids) unique to this test: the second one hits
    the cache at 48. Token ids, not text: a text header's length in tokens would depend on how the
    unique tag tokenizes, and with it whether the second request's own tail completes a block (then
    a rerun of it would reuse one block more than its first run did, and meet other noise)."""
    header = [100 + b for b in tag] + list(range(300, 332))  # 16 unique ids + 32 fixed ones
    return [
        greedy(header + list(range(400, 420)), 8, logprobs=5, return_raw_logits=True),
        greedy(header + list(range(500, 505)), 8, logprobs=5, return_raw_logits=True),
    ]


def _get(url: str, path: str) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + path) as r:
            return r.status, await r.json()

    return asyncio.run(go())


def _logits(resp: dict) -> list:
    lp = resp["choices"][0]["logprobs"]
    return [lp["top_token_ids"], lp["top_logits"], lp["token_logprobs"]]


def test_parse_fault_names_the_choices():
    assert parse_fault("perturb-kv:1e-3") == Fault("perturb-kv", 1e-3)
    assert parse_fault("perturb-kv:1e-3").name == "perturb-kv:0.001"
    assert parse_fault("corrupt-prefix-cache").name == "corrupt-prefix-cache"
    for bad in ("perturb-kv", "perturb-kv:-1", "perturb-kv:nan", "perturb-kv:x", "flip-bits", "corrupt-prefix-cache:1"):
        with pytest.raises(ConfigError, match="perturb-kv"):
            parse_fault(bad)


def test_eps_zero_is_bitwise_the_healthy_engine(engine_factory, engine):
    """perturb-kv:0 runs the whole fault path (noise drawn, blocks rescaled and rounded back) and
    must serve exactly the healthy engine's logits: the sweep's zero point is truly zero."""
    zero = engine_factory("--inject-fault", "perturb-kv:0")
    bodies = _pair(uuid.uuid4().bytes)
    want, got = run_serial(engine.url, bodies), run_serial(zero.url, bodies)
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert [_logits(r) for r in got] == [_logits(r) for r in want]
    _, log = _get(zero.url, "/fault_log")
    assert log["fault"] == "perturb-kv:0.0"
    rec = log["records"][-1]
    assert rec["cached_tokens"] == got[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert rec["kv_values"] > 0 and rec["kv_values_changed"] == 0


def test_perturbation_changes_logits_after_a_hit_only(engine_factory, engine):
    """With EPS = 0.05 (FP32), the request that reuses cached blocks gets different logits, the
    one that computed its prompt itself does not; the same hit twice gets the same noise
    (deterministic); /v1/models and /fault_log report the fault and what it changed."""
    faulty = engine_factory("--inject-fault", "perturb-kv:0.05")
    bodies = _pair(uuid.uuid4().bytes)
    want, got = run_serial(engine.url, bodies), run_serial(faulty.url, bodies)
    assert got[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _logits(got[0]) == _logits(want[0])  # no hit, no fault
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert _logits(got[1]) != _logits(want[1])
    again = run_serial(faulty.url, bodies[1:])[0]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (got[1], again)]
    assert cached == [48, 48]  # the same hit: the header's three blocks, nothing more
    assert _logits(again) == _logits(got[1])  # the block's noise is seeded by its key
    _, models = _get(faulty.url, "/v1/models")
    assert models["data"][0]["meta"]["inject_fault"] == "perturb-kv:0.05"
    _, log = _get(faulty.url, "/fault_log")
    rec = log["records"][-2]
    assert rec["prompt_sha256"] == prompt_ids_sha256(got[1]["choices"][0]["prompt_token_ids"])
    assert rec["cached_tokens"] == got[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert rec["kv_values_changed"] > 0.99 * rec["kv_values"]  # FP32: nearly every value moves
    status, _ = _get(engine.url, "/fault_log")
    assert status == 404  # no fault, no log


def test_bad_fault_is_a_usage_error():
    """A misspelt fault is refused before anything loads (exit 2, the valid spellings named)."""
    import subprocess
    import sys

    from tracekit.engine.process import REPO_ROOT

    for args in (["--inject-fault", "perturb-kv:abc"], ["--inject-fault", "perturb-kv:0.1", "--no-prefix-cache"]):
        proc = subprocess.run(
            [sys.executable, "-m", "tracekit", "serve", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "inject-fault" in proc.stderr and proc.stdout == ""
