"""The routes a replay and a chat client need from the reference engine, over real HTTP:
vLLM-style `prompt_logprobs`, tracekit's `forced_tokens` (teacher forcing on the decode path),
`/v1/chat/completions` with chat-shaped logprobs, and OpenAI's 404 for an unknown model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from support.engine_helpers import greedy, run_serial

PROMPTS = Path(__file__).resolve().parents[3] / "fixtures" / "prompts" / "cpu_small.jsonl"


def _ids(i: int) -> list[int]:
    """Token-id prompt i of cpu_small.jsonl (40-61 tokens)."""
    return json.loads(PROMPTS.read_text().splitlines()[i])["prompt"]


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
            return r.status, await r.json()

    return asyncio.run(go())


def _stream(url: str, path: str, body: dict) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json={**body, "stream": True}) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]

    return asyncio.run(go())


def _reset(url: str) -> None:
    assert _post(url, "/reset_prefix_cache", {})[0] == 200


def test_prompt_logprobs_of_the_generated_tokens_match_the_live_ones(engine_factory):
    """FP32: a live greedy run's 8 tokens, then the prompt + its first 7 tokens with
    prompt_logprobs 5 from a cold cache: position 0 is None, every other position has an entry,
    the traced tokens' entries are rank 1 with the live logprobs and logits within 1e-4, and
    the prompt token is listed first, then the top-5 by rank."""
    eng = engine_factory()
    prompt = _ids(0)[:19]
    live = run_serial(eng.url, [greedy(prompt, 8, logprobs=5, return_raw_logits=True)])[0]["choices"][0]
    ids, lps = live["token_ids"], live["logprobs"]["token_logprobs"]
    _reset(eng.url)
    body = greedy(prompt + ids[:-1], 1, prompt_logprobs=5, return_raw_logits=True)
    status, js = _post(eng.url, "/v1/completions", body)
    assert status == 200, js
    assert js["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    rows = js["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(prompt) + 7 and rows[0] is None and all(r is not None for r in rows[1:])
    for t in range(7):
        entry = rows[len(prompt) + t]
        first_key, first = next(iter(entry.items()))
        assert int(first_key) == ids[t] and first["rank"] == 1
        assert abs(first["logprob"] - lps[t]) < 1e-4
        assert abs(first["logit"] - live["logprobs"]["token_logits"][t]) < 1e-4
        assert [e["rank"] for e in list(entry.values())[1:]] == [2, 3, 4, 5]  # rank 1 is the token itself
    # the next token after the last prompt token: the live 8th
    assert js["choices"][0]["token_ids"] == [ids[7]]


def test_prompt_logprobs_under_a_prefix_hit_leave_the_reused_positions_empty(engine_factory):
    """Warm: the cache primed with 16 tokens; a 40-token prompt reuses 16 and its positions
    1..16 are None (not computed: tracekit serve reads the cache, vLLM does not)."""
    eng = engine_factory()
    prompt = _ids(1)[:40]
    _reset(eng.url)
    run_serial(eng.url, [greedy(prompt[:16], 1)])
    status, js = _post(eng.url, "/v1/completions", greedy(prompt, 1, prompt_logprobs=0))
    assert status == 200, js
    assert js["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    rows = js["choices"][0]["prompt_logprobs"]
    assert all(r is None for r in rows[:17]) and all(r is not None for r in rows[17:])
    assert all(len(r) == 1 for r in rows[17:])  # k = 0: the prompt token only


def test_prompt_logprobs_refuse_streaming(engine_factory):
    status, js = _post(engine_factory().url, "/v1/completions", greedy([5, 6, 7], 1, prompt_logprobs=2, stream=True))
    assert status == 400 and js["error"]["param"] == "prompt_logprobs"


def test_forced_tokens_replay_the_live_decode_bitwise_in_bf16(engine_factory):
    """BF16, --batch-invariant: forcing a live run's own 12 tokens gives its ids, logprobs,
    logits and top-5 bit for bit (the same prefill at the same boundary, then the same one-row
    decode steps); forcing another token at step 5 keeps steps 0-5 bitwise and reports the
    forced token's own logprob there (not the top-1's)."""
    eng = engine_factory("--dtype", "bf16", "--batch-invariant")
    prompt = _ids(2)
    body = greedy(prompt, 12, logprobs=5, return_raw_logits=True)
    _reset(eng.url)
    live = run_serial(eng.url, [body])[0]["choices"][0]
    _reset(eng.url)
    forced = run_serial(eng.url, [{**body, "forced_tokens": live["token_ids"]}])[0]["choices"][0]
    assert forced["token_ids"] == live["token_ids"]
    assert forced["logprobs"] == live["logprobs"]
    other = list(live["token_ids"])
    alt = live["logprobs"]["top_token_ids"][5][1]  # the runner-up at step 5
    other[5] = alt
    _reset(eng.url)
    js = run_serial(eng.url, [{**body, "forced_tokens": other}])[0]["choices"][0]
    lp, live_lp = js["logprobs"], live["logprobs"]
    assert js["token_ids"] == other
    assert lp["token_logprobs"][:5] == live_lp["token_logprobs"][:5]
    assert lp["top_logits"][:6] == live_lp["top_logits"][:6]  # step 5's row is computed before the force
    assert lp["token_logits"][5] == live_lp["top_logits"][5][1] < live_lp["token_logits"][5]


def test_forced_tokens_must_match_max_tokens(engine_factory):
    status, js = _post(engine_factory().url, "/v1/completions", greedy([5, 6, 7], 3, forced_tokens=[1, 2]))
    assert status == 400 and js["error"]["param"] == "max_tokens"


def test_unknown_model_gets_openais_404(engine_factory):
    url = engine_factory().url
    for path, body in (
        ("/v1/completions", greedy([5, 6], 1, model="gpt-none")),
        ("/v1/chat/completions", {"model": "gpt-none", "messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, js = _post(url, path, body)
        assert status == 404
        assert js["error"]["code"] == "model_not_found" and js["error"]["type"] == "invalid_request_error"
        assert "gpt-none" in js["error"]["message"] and js["error"]["param"] == "model"


def test_chat_completions_with_logprobs_equal_the_completions_route(engine_factory):
    """The chat route renders the messages (the fixture has no chat template: the plain
    layout), and its content[] logprobs are the completions route's for the same prompt text,
    also when streamed; the served model name is accepted."""
    url = engine_factory().url
    name = _post(url, "/v1/completions", greedy([5, 6], 1))[1]["model"]
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def add(a, b):"}]
    chat = {"model": name, "messages": msgs, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _reset(url)  # each run cold: the same prompt from the same boundary
    status, js = _post(url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 3})
    assert status == 200, js
    assert js["object"] == "chat.completion"
    c = js["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == 10 and all(len(e["top_logprobs"]) == 3 for e in content)
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    text = "<|system|>\nBe terse.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"
    _reset(url)
    ref = _post(url, "/v1/completions", greedy(text, 10, logprobs=3))[1]["choices"][0]
    assert [e["logprob"] for e in content] == ref["logprobs"]["token_logprobs"]
    assert c["message"] == {"role": "assistant", "content": ref["text"]}
    _reset(url)
    chunks = _stream(url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 3})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = [e for ch in chunks[1:] for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == ref["text"]
