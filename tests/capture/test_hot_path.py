"""The inlined hot-event path of the OpenAI/vLLM dialect and Acc's compact top-k form
give exactly the columns of the general path, for every event shape around them."""

from __future__ import annotations

import numpy as np
import pytest

from capture.dialects import Acc, get


def _event(i: int, keys: list[str], lps: list[float], **extra) -> dict:
    ch = {
        "index": 0,
        "text": "x",
        "logprobs": {
            "text_offset": [i],
            "token_logprobs": [lps[0]],
            "tokens": [keys[0]],
            "top_logprobs": [dict(zip(keys, lps))],
        },
        "finish_reason": None,
        "token_ids": [100 + i],
    }
    ch.update(extra.pop("choice", {}))
    return {"id": "c", "object": "text_completion", "choices": [ch], "usage": None, **extra}


def _stream(kind: str) -> list[dict]:
    rng = np.random.default_rng(0)
    evs = []
    for i in range(12):
        w = 3 if kind != "ragged" else 1 + i % 4
        lps = sorted((-rng.random(w) * 5).tolist(), reverse=True)
        keys = [f"token_id:{j}" for j in rng.choice(5000, w, replace=False)]
        if kind == "strings":
            keys = [" the", "cat", f"w {i}"][:w] if i % 2 else ["a", "b", "c"][:w]
        if kind == "mixed" and i == 7:
            keys[0] = "a key"  # a space inside a key after compact rows: they convert back exactly
        extra = {}
        if i == 0:
            extra["prompt_token_ids"] = [1, 2, 3]
        if i == 5:
            extra["usage"] = {"prompt_tokens": 3, "completion_tokens": 6}  # continuous usage stats
        if i == 11:
            extra["choice"] = {"finish_reason": "length"}
        evs.append(_event(i, keys, lps, **extra))
    evs.append(
        {
            "id": "c",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2}},
        }
    )
    return evs


@pytest.mark.parametrize("kind", ["token_ids", "ragged", "strings", "mixed"])
def test_hot_path_matches_general_path(kind):
    d = get("vllm")
    fast, slow, dicts = Acc(), Acc(), Acc()
    dicts.start_legacy()
    dicts._to_maps()  # the reference: the parsed dicts kept as they come
    for j, ev in enumerate(_stream(kind)):
        d.parse_event(ev, fast, 0.5 * j)
        d._parse_general(ev, slow, 0.5 * j)
        d._parse_general(ev, dicts, 0.5 * j)
    assert (
        (fast.finish_reason, fast.cached_tokens, fast.prompt_len, fast.prompt_ids)
        == (slow.finish_reason, slow.cached_tokens, slow.prompt_len, slow.prompt_ids)
        == ("length", 2, 3, [1, 2, 3])
    )
    mapper = (lambda strs: [len(s) for s in strs]) if kind in ("strings", "mixed") else None
    a, b, c = (x.columns(4, False, mapper) for x in (fast, slow, dicts))
    assert dicts.top_keys is None and (slow.top_maps is None) == (kind in ("token_ids", "ragged"))
    for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        np.testing.assert_array_equal(getattr(a, name), getattr(c, name), err_msg=name)
    assert len(a.token_id) == 12 and (a.topk_id[:, 0] >= 0).all()
    assert a.t_arrival_s[3] == 1.5
    if kind == "token_ids":
        assert fast.top_keys is not None and fast.top_maps is None  # stayed compact
        assert (a.topk_id[:, 3] == -1).all() and np.isnan(a.topk_logprob[:, 3]).all()  # width 3 < k 4
    if kind == "mixed":
        assert fast.top_maps is not None and a.topk_id[7, 0] == len("a key")


def test_a_row_that_cannot_split_back_gets_unknown_ids():
    """A "token_id:" first key admits a row to the inlined path; a later key with a space
    then makes that row's ids unknown (-1), the other rows keep theirs."""
    d, acc = get("vllm"), Acc()
    d.parse_event(_event(0, ["token_id:1", "token_id:2"], [-0.1, -2.0]), acc, 0.0)
    d.parse_event(_event(1, ["token_id:3", "odd key"], [-0.2, -3.0]), acc, 0.1)
    d.parse_event(_event(2, ["token_id:5", "token_id:6"], [-0.3, -4.0]), acc, 0.2)
    cols = acc.columns(2, False, lambda strs: [7] * len(strs))
    assert cols.topk_id.tolist() == [[7, 7], [-1, -1], [7, 7]]
    np.testing.assert_allclose(cols.topk_logprob[1], [-0.2, -3.0])


def test_stream_with_infinity_and_crlf_events_parses_through_the_client():
    """Through a real socket: -Infinity (Python's json.dumps writes it; orjson refuses it, the
    client falls back to json) and a CRLF event in the middle (the SSE spec path) both parse."""
    import asyncio
    import json

    from aiohttp import web

    from capture.client import Clock, make_session, send
    from capture.dialects import RequestSpec

    evs = [_event(i, [f"token_id:{i}", "token_id:9"], [-0.5, float("-inf") if i == 1 else -2.0]) for i in range(3)]
    evs[2]["choices"][0]["finish_reason"] = "length"
    body = [b"data: " + json.dumps(e).encode() + (b"\r\n\r\n" if i == 2 else b"\n\n") for i, e in enumerate(evs)]

    async def main():
        async def completions(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for part in body + [b"data: [DONE]\n\n"]:
                await resp.write(part)
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with make_session(1, 10.0) as s:
                spec = RequestSpec("k", [1, 2], 3, 2, False, True)
                return await send(s, f"http://127.0.0.1:{port}", get("vllm"), spec, Clock())
        finally:
            await runner.cleanup()

    outcome, acc = asyncio.run(main())
    assert outcome.record.status == "ok", outcome.record.error
    cols = acc.columns(2, False, None)
    assert cols.topk_id.tolist() == [[0, 9], [1, 9], [2, 9]]
    assert cols.topk_logprob[1, 1] == float("-inf") and acc.finish_reason == "length"
