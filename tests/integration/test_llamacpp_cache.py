"""llama.cpp's prefix cache under the capture's control (issue 24, item 4): the native dialect
sends `cache_prompt` only when asked, so a server started with `--no-cache-prompt` runs cache-off
(a per-request `cache_prompt: true` used to override it), and `--no-cache-prompt` on the capture
gives cold prompts on a cache-on server."""

from __future__ import annotations

import json

import pytest
from support import load_file

from tracekit.store import TraceReader

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
