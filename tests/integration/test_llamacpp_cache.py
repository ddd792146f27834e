"""llama.cpp's prefix cache under the capture's control (issue 24, item 4): the native dialect
sends `cache_prompt` only when asked, so a server started with `--no-cache-prompt` runs cache-off
(a per-request `cache_prompt: true` used to override it), and `--no-cache-prompt` on the capture
gives cold prompts on a cache-on server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import load_file

from tracekit.store import TraceReader

PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "cpu_small.jsonl"

llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
EVIDENCE_FLAGS, start_server = llamacpp.EVIDENCE_FLAGS, llamacpp.start_server


def _cached(out) -> tuple[list[int], list[dict], dict]:
    with TraceReader(out) as r:
        rows = [r.record(i) for i in range(len(r))]
        return [x.cached_tokens for x in rows], [json.loads(x.params) for x in rows], r.meta.run


@pytest.fixture(scope="module")
def cache_off_server(llama_bin, gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("llama-nocache") / "llama-server.log"
    with start_server(llama_bin, gguf, slots=1, extra=(*EVIDENCE_FLAGS, "--no-cache-prompt"), log_path=str(log)) as e:
        yield e


def test_a_cache_off_server_stays_cache_off(cache_off_server, capture):
    """Twice the same 8 prompts, serially, on one slot: with the server's --no-cache-prompt no
    request reuses anything (before the fix every request said cache_prompt true: 32-61 reused)."""
    for name in ("first", "second"):
        s, out = capture(cache_off_server.url, f"nocache-{name}", max_tokens=4)
        assert s.failed == 0, s.failures
    cached, params, run = _cached(out)
    assert cached == [0] * 8, cached
    assert all("cache_prompt" not in p for p in params), params[0]
    assert run["cache_prompt"] == "not sent" and run["cache"]["setting"] == "unknown"


def test_cache_prompt_asked_per_request(llama, capture):
    """On a cache-on server: not sent, the server's default reuses the shared 32-token prefix;
    --no-cache-prompt (cache_prompt false in every body) gives cold prompts, recorded as cache off."""
    _, warm = capture(llama.url, "warm", max_tokens=4)
    _, cold = capture(llama.url, "cold", max_tokens=4, cache_prompt=False)
    cached_warm, _, _ = _cached(warm)
    cached_cold, params, run = _cached(cold)
    assert max(cached_warm) >= 32, cached_warm
    assert cached_cold == [0] * 8, cached_cold
    assert all(p["cache_prompt"] is False for p in params)
    assert run["cache_prompt"] is False and run["cache"]["setting"] == "off"


@pytest.fixture(scope="module")
def small_ctx(llama_bin, gguf, tmp_path_factory):
    """4 slots of 256 tokens (llama.cpp's smallest slot: -c 512 -np 4 is rounded up to 1024)."""
    log = tmp_path_factory.mktemp("llama-ctx") / "llama-server.log"
    with start_server(llama_bin, gguf, slots=4, ctx=512, log_path=str(log)) as e:
        yield e


def test_context_truncation_recorded_and_not_blamed_on_the_pair(small_ctx, capture):
    """Issue 24, item 6: llama.cpp stops at its context limit (`truncated: true`, `stop_type:
    limit`); the capture records it (finish reason context_limit) and warns, and the diff says
    "both truncated by the engine's context limit" instead of calling same-token pairs unexplained."""
    from tracekit.analyze.compare import diff

    # cpu_small's 8 prompts behind 192 tokens of their shared prefix: 232-253 tokens, so 64 asked
    # fill the 256-token slot after 3-24.
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [{"id": p["id"], "prompt": p["prompt"][:32] * 6 + p["prompt"]} for p in prompts]
    s1, serial = capture(small_ctx.url, "ctx-serial", prompts, max_tokens=64)
    s4, burst = capture(small_ctx.url, "ctx-burst", prompts, max_tokens=64, concurrency=4)
    assert s1.failed == s4.failed == 0 and "context_truncated" in s1.pitfalls, s1.pitfalls
    with TraceReader(serial) as r:
        rows = [r.record(i) for i in range(len(r))]
        assert any(p["code"] == "context_truncated" for p in r.meta.run["pitfalls"])
    assert {x.finish_reason for x in rows} == {"context_limit"}
    assert all(x.prompt_len + x.output_len == 256 and x.output_len < 64 for x in rows), [
        (x.prompt_len, x.output_len) for x in rows
    ]
    res = diff(serial, burst)
    counts = res.counts()
    assert counts["pairs"] == 8 and counts["unexplained"] == 0 and counts["incomparable"] == 0, counts
    assert counts["identical"] >= 6, counts
    assert any(n.startswith("8 pair(s) both truncated by the engine's context limit") for n in res.notes), res.notes
    for key in ("c0", "c1"):
        p = res.by_key(key)
        assert "both truncated by the engine's context limit" in p.note and p.truncated_a is None, (
            p.note,
            p.truncated_a,
        )
