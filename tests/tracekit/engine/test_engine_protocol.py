"""The response fields the capture client reads: logprobs layout, raw logits, token ids, stop strings."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
from support.engine_helpers import BF16_BASE, greedy, metric, run_serial

PROMPT = "class Node:\n    def __init__(self, value, next=None):\n        "


def test_raw_logits_agree_with_logprobs(engine):
    """top_logits must be the raw logits behind top_logprobs: equal differences between candidates,
    the chosen token first under greedy, and ids in the same order as the top_logprobs keys."""
    r = run_serial(
        engine.url, [greedy(PROMPT, 8, logprobs=5, return_raw_logits=True, return_tokens_as_token_ids=True)]
    )[0]
    lp = r["choices"][0]["logprobs"]
    ids = r["choices"][0]["token_ids"]
    assert len(lp["top_logits"]) == len(lp["top_token_ids"]) == len(lp["token_logits"]) == 8
    for t in range(8):
        keys = list(lp["top_logprobs"][t])
        assert keys == [f"token_id:{i}" for i in lp["top_token_ids"][t]]
        assert lp["tokens"][t] == f"token_id:{ids[t]}" and lp["top_token_ids"][t][0] == ids[t]
        assert lp["token_logits"][t] == lp["top_logits"][t][0]
        tops = list(lp["top_logprobs"][t].values())
        assert lp["top_logits"][t] == sorted(lp["top_logits"][t], reverse=True)
        for k in range(1, 5):
            assert math.isclose(tops[0] - tops[k], lp["top_logits"][t][0] - lp["top_logits"][t][k], abs_tol=1e-4)


def test_bf16_raw_logits_are_exact_bf16_values(engine_factory):
    """In BF16 the raw logits must be exact BF16 numbers, so analysis can count ULPs."""
    import torch

    eng = engine_factory(*BF16_BASE)
    r = run_serial(eng.url, [greedy(PROMPT, 6, logprobs=3, return_raw_logits=True)])[0]
    vals = torch.tensor([v for row in r["choices"][0]["logprobs"]["top_logits"] for v in row], dtype=torch.float64)
    assert torch.equal(vals.to(torch.bfloat16).to(torch.float64), vals)


def test_prompt_as_token_ids_equals_prompt_as_text(engine):
    a = run_serial(engine.url, [greedy(PROMPT, 8)])[0]["choices"][0]
    b = run_serial(engine.url, [greedy(a["prompt_token_ids"], 8)])[0]["choices"][0]
    assert b["token_ids"] == a["token_ids"] and b["text"] == a["text"]


async def _stream_text(url: str, body: dict) -> tuple[str, list[dict]]:
    events = []
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                events.append({"done": True})
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_stop_string_ends_the_request(engine):
    """A stop string cuts the text before it, finish_reason 'stop' with stop_reason = the string, the
    slot is released as finished (not cancelled), and streaming never leaks the stop string."""
    full = run_serial(engine.url, [greedy(PROMPT, 24)])[0]["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and len(stop) == 3
    want = full[: full.index(stop)]
    cancelled0 = metric(engine.url, "tracekit:requests_cancelled_total")
    r = run_serial(engine.url, [greedy(PROMPT, 24, stop=[stop])])[0]["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (want, "stop", stop)
    text, events = asyncio.run(_stream_text(engine.url, greedy(PROMPT, 24, stop=stop, stream=True)))
    assert text == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == {"done": True}
    assert metric(engine.url, "tracekit:requests_cancelled_total") == cancelled0


def test_seeded_sampling_is_reproducible(engine):
    """temperature > 0 with a seed samples from a per-request generator: the same seed gives the same
    tokens; another seed gives another sample."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "return_token_ids": True, "ignore_eos": True}
    a, b, c = run_serial(engine.url, [{**body, "seed": 7}, {**body, "seed": 7}, {**body, "seed": 8}])
    ids = [r["choices"][0]["token_ids"] for r in (a, b, c)]
    assert ids[0] == ids[1] != ids[2]


def test_tiny_temperature_is_greedy(engine):
    """temperature 1e-45 passes validation (it is in [0, 2]) but logits / 1e-45 overflow: below
    1e-5 the engine samples greedily (vLLM's convention) instead of failing the request."""
    body = {"prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, "ignore_eos": True}
    tiny, greedy_ = run_serial(engine.url, [{**body, "temperature": 1e-45, "seed": 3}, {**body, "temperature": 0}])
    assert tiny["choices"][0]["token_ids"] == greedy_["choices"][0]["token_ids"]
