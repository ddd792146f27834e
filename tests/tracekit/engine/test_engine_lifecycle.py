"""Client disconnect, bad input, auth: the engine frees resources and stays healthy."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from support.engine_helpers import greedy, metric, run_serial

PROMPT = "def handle_request(self):\n    timeout = self.socket.gettimeout()\n"


async def _stream_then_drop(url: str, n_tokens: int) -> list[int]:
    """Read n_tokens streamed token events, then close the connection abruptly."""
    body = greedy(PROMPT, 400, stream=True)
    got: list[int] = []
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/completions", json=body)
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                got += json.loads(line[6:])["choices"][0]["token_ids"]
                if len(got) >= n_tokens:
                    break
        resp.close()  # drops the TCP connection mid-stream
    return got


def test_disconnect_frees_slot_and_next_request_matches(engine):
    """A streaming client that disconnects after 3 tokens must get its slot freed (the request
    asked for 400 tokens: a leaked slot would stay busy for them all), and the next request must
    match its baseline (no state leaks from the cancelled one)."""
    baseline = run_serial(engine.url, [greedy(PROMPT, 24)])[0]["choices"][0]["token_ids"]
    cancelled0 = metric(engine.url, "tracekit:requests_cancelled_total")
    gen0 = metric(engine.url, "tracekit:generation_tokens_total")
    got = asyncio.run(_stream_then_drop(engine.url, 3))
    assert got == baseline[:3]
    # Wait on the event itself (the cancel counter moves when the loop frees the slot); the
    # deadline only bounds a hang, it is not a timing assumption.
    deadline = time.monotonic() + 120
    while metric(engine.url, "tracekit:requests_cancelled_total") < cancelled0 + 1:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.02)
    assert metric(engine.url, "tracekit:slots_busy") == 0
    assert metric(engine.url, "tracekit:generation_tokens_total") - gen0 < 400
    assert metric(engine.url, "tracekit:num_requests_running") == 0
    assert metric(engine.url, "tracekit:requests_cancelled_total") == cancelled0 + 1
    after = run_serial(engine.url, [greedy(PROMPT, 24)])[0]["choices"][0]["token_ids"]
    assert after == baseline


OK_BODY = {"prompt": "import os\n", "max_tokens": 4, "temperature": 0}
BAD = {
    "prompt_too_long": json.dumps({**OK_BODY, "prompt": [5] * 2100}).encode(),
    "prompt_plus_max_tokens_too_long": json.dumps({**OK_BODY, "prompt": [5] * 2000, "max_tokens": 100}).encode(),
    "logprobs_21": json.dumps({**OK_BODY, "logprobs": 21}).encode(),
    "max_tokens_0": json.dumps({**OK_BODY, "max_tokens": 0}).encode(),
    "token_id_out_of_vocab": json.dumps({**OK_BODY, "prompt": [5, 2048]}).encode(),
    "negative_token_id": json.dumps({**OK_BODY, "prompt": [-1, 5]}).encode(),
    "malformed_json": b'{"prompt": "import os", "max_tokens": 4',
    "not_an_object": b"[1, 2, 3]",
    "empty_prompt": json.dumps({**OK_BODY, "prompt": ""}).encode(),
    "max_tokens_huge": json.dumps({**OK_BODY, "max_tokens": 10**30}).encode(),
    "seed_2_64": json.dumps({**OK_BODY, "temperature": 1.0, "seed": 2**64}).encode(),
    "lone_surrogate_prompt": b'{"prompt": "abc\\ud800", "max_tokens": 4}',
    "lone_surrogate_stop": b'{"prompt": "import os", "max_tokens": 4, "stop": ["\\udfff"]}',
    "nested_50000_deep": b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "body_over_limit": json.dumps({**OK_BODY, "prompt": "x" * (2 << 20)}).encode(),
}
STATUS = {"body_over_limit": 413}


async def _post_raw(url: str, data: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_400_and_engine_stays_healthy(engine, case):
    """Each bad input gets 400 (413 for a body over the limit) with an OpenAI-style error object,
    never a 500, and a normal request still works."""
    status, body = asyncio.run(_post_raw(engine.url, BAD[case]))
    assert status == STATUS.get(case, 400), body
    err = body["error"]
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert "\n" not in err["message"]
    status, ok = asyncio.run(_post_raw(engine.url, json.dumps(OK_BODY).encode()))
    assert status == 200 and ok["usage"]["completion_tokens"] == 4


def test_api_key_required_when_configured(engine_factory, monkeypatch):
    """--api-key-env VAR: /v1 routes need the bearer key; /health stays open for readiness."""
    monkeypatch.setenv("TRACEKIT_TEST_KEY", "s3cret")
    eng = engine_factory("--api-key-env", "TRACEKIT_TEST_KEY")

    async def go(headers):
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(f"{eng.url}/v1/completions", json=OK_BODY) as r:
                return r.status

    assert asyncio.run(go({})) == 401
    assert asyncio.run(go({"Authorization": "Bearer wrong"})) == 401
    assert asyncio.run(go({"Authorization": "Bearer s3cret"})) == 200
    assert "s3cret" not in open(eng.log_path).read()


def test_prompt_filling_the_context_exactly_is_served(engine):
    """prompt + max_tokens == max_context is allowed and yields every asked token (the edge of the
    'prompt too long' check)."""
    status, body = asyncio.run(
        _post_raw(
            engine.url,
            json.dumps({"prompt": [5] * 2040, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode(),
        )
    )
    assert status == 200, body
    u = body["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (2040, 8, 2048)
