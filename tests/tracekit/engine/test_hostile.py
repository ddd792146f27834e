"""The engine under hostile or careless clients: bad requests never touch other requests, slow
clients are cut off, the prefix cache can be emptied, the key is required, loopback by default.

Every wait here is for an event (a token, a closed socket, a response); deadlines only bound a
hang. Bad bodies themselves are in test_engine_lifecycle.py (400/413, never 500).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import aiohttp
import pytest
from support.engine_helpers import greedy, metric, run_serial

from tracekit.engine.connections import exposure_warning, is_loopback
from tracekit.engine.process import REPO_ROOT

LONG = 1800  # tokens per stream: thousands of decode steps, so the streams are surely in flight
PROMPTS = ["import os\nimport sys\n", "class Node:\n    def __init__(self", "def main():\n    ", "# utils\n"]


async def _bad_while_streaming(url: str) -> tuple[list[int], list[list[int]], list[int]]:
    """Open 4 long streams; once each has its first token, send bad requests (seed 2^64 with
    temperature > 0, seed below -2^63, a lone surrogate); then read 32 more tokens per stream.
    Returns the bad requests' statuses, each stream's tokens, and each stream's token count when
    the last bad answer came back."""
    async with aiohttp.ClientSession() as s:
        resps = [await s.post(f"{url}/v1/completions", json=greedy(p, LONG, stream=True)) for p in PROMPTS]
        toks: list[list[int]] = [[] for _ in resps]

        async def read_until(i: int, n: int) -> None:
            while len(toks[i]) < n:
                line = (await resps[i].content.readline()).decode().strip()
                assert line != "data: [DONE]" and '"error"' not in line, line
                if line.startswith("data: {"):
                    toks[i] += json.loads(line[6:])["choices"][0]["token_ids"]

        await asyncio.gather(*(read_until(i, 1) for i in range(len(resps))))
        statuses = []
        for body in (
            {"prompt": "x", "max_tokens": 4, "temperature": 1.0, "seed": 2**64},
            {"prompt": "x", "max_tokens": 4, "temperature": 0.5, "seed": -(2**63) - 1},
            {"prompt": "abc\ud800", "max_tokens": 4},
        ):
            async with s.post(f"{url}/v1/completions", json=body) as r:
                statuses.append(r.status)
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        at_bad = [len(t) for t in toks]
        await asyncio.gather(*(read_until(i, at_bad[i] + 32) for i in range(len(resps))))
        for r in resps:
            r.close()  # disconnect: the slots must come back
        return statuses, toks, at_bad


def test_bad_seed_never_touches_running_streams(engine):
    """A seed >= 2^64 with temperature > 0 once killed every request in flight. Now it gets its own
    400 (as do other bad requests) while 4 streams run, and those streams go on token for token
    as if alone (FP32), without an error event; the engine counts no internal error."""
    errors0 = metric(engine.url, "tracekit:request_errors_total")
    statuses, toks, at_bad = asyncio.run(_bad_while_streaming(engine.url))
    assert statuses == [400, 400, 400]
    assert all(n < LONG for n in at_bad)  # the bad requests really came while the streams ran
    solo = run_serial(engine.url, [greedy(p, len(t)) for p, t in zip(PROMPTS, toks)])
    assert toks == [r["choices"][0]["token_ids"] for r in solo]
    assert metric(engine.url, "tracekit:request_errors_total") == errors0


async def _slow_client(url: str, data: bytes) -> bytes:
    """Connect, send `data`, never send the rest; return whatever comes back until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 120)  # b"" or a response, then EOF
    finally:
        writer.close()


def test_slow_clients_are_cut_off(engine_factory):
    """A client that never finishes its headers is disconnected after --read-timeout; one that
    never finishes its body gets 408 and is disconnected; the engine then serves normally."""
    eng = engine_factory("--read-timeout", "2")
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    assert asyncio.run(_slow_client(eng.url, partial)) == b""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    got = asyncio.run(_slow_client(eng.url, head + b'{"prompt":'))
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert run_serial(eng.url, [greedy("import os\n", 4)])[0]["usage"]["completion_tokens"] == 4


def test_reset_prefix_cache_empties_it(engine):
    """POST /reset_prefix_cache (vLLM's name) drops every cached block: the same prompt that hit
    the cache before the reset computes its whole prompt after it."""
    header = f"# {uuid.uuid4().hex}\n" + "def f(x):\n    return x + 1\n\n\n" * 4
    a, b = run_serial(engine.url, [greedy(header + "a = 1\n", 2), greedy(header + "b = 2\n", 2)])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32

    async def reset():
        async with aiohttp.ClientSession() as s, s.post(f"{engine.url}/reset_prefix_cache") as r:
            return r.status, await r.json()

    status, body = asyncio.run(reset())
    assert status == 200 and body["blocks_dropped"] >= 2
    assert metric(engine.url, "tracekit:prefix_cache_blocks") == 0
    c = run_serial(engine.url, [greedy(header + "b = 2\n", 2)])[0]
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert c["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_api_key_guards_every_route_but_health_and_metrics(engine_factory, monkeypatch):
    """With --api-key-env, /v1/*, /reset_prefix_cache need the key; /health and /metrics do not."""
    monkeypatch.setenv("TRACEKIT_TEST_KEY", "s3cret")
    eng = engine_factory("--api-key-env", "TRACEKIT_TEST_KEY")

    async def go(method, path, headers):
        async with aiohttp.ClientSession(headers=headers) as s, s.request(method, eng.url + path) as r:
            return r.status

    assert asyncio.run(go("POST", "/reset_prefix_cache", {})) == 401
    assert asyncio.run(go("GET", "/v1/models", {"Authorization": "Bearer s3cre"})) == 401
    assert asyncio.run(go("POST", "/reset_prefix_cache", {"Authorization": "Bearer s3cret"})) == 200
    assert asyncio.run(go("GET", "/health", {})) == 200 and asyncio.run(go("GET", "/metrics", {})) == 200


def test_api_key_env_unset_is_one_error_line():
    """--api-key-env naming an unset variable must refuse to start (an engine without the key it
    was told to require would be open): one `Error:` line, exit 3."""
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_UNSET_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "tracekit", "serve", "--port", "0", "--api-key-env", "TRACEKIT_UNSET_KEY"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=env,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1 and lines[0].startswith("Error: ")
    assert "TRACEKIT_UNSET_KEY" in lines[0]


def test_loopback_by_default_and_warning_elsewhere(engine):
    """The default bind is 127.0.0.1; any address other machines can reach gets a stderr warning
    (tested on the function: binding a public address in a test would expose the engine)."""
    assert engine.url.startswith("http://127.0.0.1:")
    assert "WARNING" not in open(engine.log_path).read()
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host) and exposure_warning(host, api_key=False) is None
    for host in ("0.0.0.0", "", "::", "10.1.2.3"):
        w = exposure_warning(host, api_key=False)
        assert not is_loopback(host) and w and "WARNING" in w and "--api-key-env" in w


@pytest.mark.parametrize("size", [(1 << 20) + 1])
def test_chunked_body_over_limit_is_413(engine, size):
    """A body over the limit sent without Content-Length (chunked) is cut at the limit: 413."""

    async def chunks():
        for _ in range(size // 65536 + 1):
            yield b"x" * 65536

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{engine.url}/v1/completions", data=chunks()) as r:
                return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 413 and "larger than" in body["error"]["message"]
