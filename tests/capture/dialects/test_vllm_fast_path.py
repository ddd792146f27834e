"""The vLLM dialect's token-event fast path (`_vllm_token_event`: subscripts and unpacking) leaves
the accumulator exactly as the general path (`_parse`) does, or raises the same error, for the
event vLLM streams and for every field of it changed to another shape or type; and the client
still parses streams with the json module when orjson is missing."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.capture.dialects import Acc, get
from tracekit.capture.dialects.openai import _parse, _vllm_token_event

ROOT = Path(__file__).resolve().parents[3]


def _vllm_event(**choice) -> dict:
    """vLLM 0.33's streamed token event (completions route, return_tokens_as_token_ids and
    return_token_ids on), with its explicit nulls."""
    ch = {
        "index": 0,
        "text": " w7",
        "logprobs": {
            "text_offset": [4],
            "token_logprobs": [-0.25],
            "tokens": ["token_id:7"],
            "top_logprobs": [{"token_id:7": -0.25, "token_id:3": -1.5, "token_id:11": -2.0}],
        },
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": [7],
        "weight_versions": None,
    }
    ch.update(choice)
    return {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [ch], "usage": None}


DELETE = object()


def _set(path: tuple, value):
    """A copy of the token event with the field at `path` set to value (DELETE: removed)."""
    ev = _vllm_event()
    node = ev
    for p in path[:-1]:
        node = node[p]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return ev


C, LP = ("choices", 0), ("choices", 0, "logprobs")
CASES = {
    "the token event": _vllm_event(),
    "the first event (prompt ids)": _vllm_event(prompt_token_ids=[1, 2, 3]),
    "the last token (finish reason)": _vllm_event(finish_reason="length", stop_reason=None),
    "the usage event": {"id": "c", "choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 4}}},
    "usage on a token event": {**_vllm_event(), "usage": {"prompt_tokens_details": {"cached_tokens": 2}}},
    "prompt ids at the top level": {**_vllm_event(), "prompt_token_ids": [9, 8]},
    "an error object": {"error": {"message": "boom", "code": 500}},
    "an error beside a choice": {**_vllm_event(), "error": "overloaded"},
    "a null error": {**_vllm_event(), "error": None},
    "not an object": [1, 2],
    "a string": "x",
    "choices an object": {**_vllm_event(), "choices": {"0": _vllm_event()["choices"][0]}},
    "choices a one-character string": {**_vllm_event(), "choices": "x"},
    "two choices": {**_vllm_event(), "choices": _vllm_event()["choices"] * 2},
    "choices null": {**_vllm_event(), "choices": None},
    "a choice that is a list": {**_vllm_event(), "choices": [[1]]},
    "a choice that is a string": {**_vllm_event(), "choices": ["x"]},
    "choice index 1": _set(C + ("index",), 1),
    "no choice index": _set(C + ("index",), DELETE),
    "logprobs null": _set(C + ("logprobs",), None),
    "logprobs empty": _set(C + ("logprobs",), {}),
    "logprobs a list": _set(C + ("logprobs",), [1]),
    "chat-style content": _set(C + ("logprobs",), {"content": [{"id": 5, "logprob": -0.5, "top_logprobs": []}]}),
    "top_logprobs an object": _set(LP + ("top_logprobs",), {"token_id:7": -0.25}),
    "top_logprobs a string": _set(LP + ("top_logprobs",), "x"),
    "top_logprobs null": _set(LP + ("top_logprobs",), None),
    "a null top-k row": _set(LP + ("top_logprobs",), [None]),
    "an empty top-k row": _set(LP + ("top_logprobs",), [{}]),
    "a top-k row that is a number": _set(LP + ("top_logprobs",), [1]),
    "two top-k rows": _set(LP + ("top_logprobs",), [{"token_id:7": -0.25}, {"token_id:8": -0.5}]),
    "tokens a string": _set(LP + ("tokens",), "a"),
    "tokens empty": _set(LP + ("tokens",), []),
    "two tokens": _set(LP + ("tokens",), ["token_id:7", "token_id:8"]),
    "tokens null": _set(LP + ("tokens",), None),
    "no tokens": _set(LP + ("tokens",), DELETE),
    "token_logprobs a string": _set(LP + ("token_logprobs",), "x"),
    "a null logprob": _set(LP + ("token_logprobs",), [None]),
    "an integer logprob": _set(LP + ("token_logprobs",), [0]),
    "a string logprob": _set(LP + ("token_logprobs",), ["x"]),
    "two logprobs": _set(LP + ("token_logprobs",), [-0.25, -0.5]),
    "token_ids null": _set(C + ("token_ids",), None),
    "no token_ids": _set(C + ("token_ids",), DELETE),
    "token_ids empty": _set(C + ("token_ids",), []),
    "two token_ids": _set(C + ("token_ids",), [7, 8]),
    "token_ids a string": _set(C + ("token_ids",), "7"),
    "a string token id": _set(C + ("token_ids",), ["7"]),
    "raw logits without their ids": _set(LP + ("top_logits",), [[1.0, 0.5, 0.25]]),
    "null raw logits": _set(LP + ("top_logits",), None),
    "raw logits": None,  # _with_logits(), below
    "prompt ids not a list": _set(C + ("prompt_token_ids",), 5),
    "a finish reason that is a number": _set(C + ("finish_reason",), 3),
}


def _with_logits() -> dict:
    """tracekit serve's event with raw logits (`top_logits` and their `top_token_ids`)."""
    ev = _set(LP + ("top_logits",), [[1.0, 0.5, 0.25]])
    ev["choices"][0]["logprobs"]["top_token_ids"] = [[7, 3, 11]]
    return ev


CASES["raw logits"] = _with_logits()


def _state(acc: Acc) -> dict:
    return {name: copy.deepcopy(getattr(acc, name)) for name in Acc.__slots__}


def _run(fn, events, acc: Acc):
    try:
        for j, ev in enumerate(events):
            fn(copy.deepcopy(ev), acc, 0.5 * j)
    except Exception as e:  # the same error, raised at the same event
        return type(e), str(e), _state(acc)
    return None, "", _state(acc)


@pytest.mark.parametrize("logits_before", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_equals_the_general_path(case, logits_before):
    """Two ordinary events, then the case: the same accumulator or the same error either way.
    `logits_before`: an earlier event carried raw logits (acc.top_logits set)."""
    first = _with_logits() if logits_before else _vllm_event()
    events = [first, _vllm_event(), CASES[case]]
    fast = _run(_vllm_token_event, events, Acc())
    general = _run(_parse, events, Acc())
    assert fast == general
    if logits_before:
        assert general[2]["top_logits"][:3] == [1.0, 0.5, 0.25]


def test_the_fast_path_takes_the_token_event_and_builds_its_columns():
    """The dialect's parse_event is the fast path, and its columns are the general path's."""
    d = get("vllm")
    assert d.parse_event is _vllm_token_event and get("openai").parse_event is _parse
    events = [_vllm_event(prompt_token_ids=[1, 2]), _vllm_event(), _vllm_event(finish_reason="length")]
    events.append(CASES["the usage event"])
    a, b = Acc(), Acc()
    for j, ev in enumerate(events):
        d.parse_event(ev, a, float(j))
        _parse(ev, b, float(j))
    ca, cb = a.columns(4, False, None), b.columns(4, False, None)
    assert ca.topk_id.tolist() == cb.topk_id.tolist() == [[7, 3, 11, -1]] * 3
    assert ca.token_id.tolist() == [7, 7, 7] and ca.t_arrival_s.tolist() == [0.0, 1.0, 2.0]
    assert (a.prompt_ids, a.finish_reason, a.cached_tokens) == ([1, 2], "length", 4)


JSON_FALLBACK = r"""
import asyncio, json, sys
sys.modules["orjson"] = None  # as on an image without orjson
from aiohttp import web
from tracekit.capture import client
from tracekit.capture.client import Clock, make_session, send
from tracekit.capture.dialects import RequestSpec, get

assert client._loads is json.loads, client._loads
events = json.loads(sys.argv[1])

async def main():
    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(b"data: " + e.encode() + b"\n\n")
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
            spec = RequestSpec("k", [1, 2], 3, 3, False, True)
            return await send(s, f"http://127.0.0.1:{port}", get("vllm"), spec, Clock())
    finally:
        await runner.cleanup()

outcome, acc = asyncio.run(main())
cols = acc.columns(3, False, None) if outcome.record.status == "ok" else None
print(json.dumps({"status": outcome.record.status, "error": outcome.record.error,
                  "topk": cols.topk_id.tolist() if cols is not None else None}))
"""


@pytest.mark.parametrize("broken", [False, True])
def test_the_client_falls_back_to_json_without_orjson(broken):
    """Without orjson the stream is parsed by json.loads: the same columns; a malformed event is
    still the row's error, naming the event."""
    evs = [json.dumps(_vllm_event()), json.dumps(_vllm_event(finish_reason="length"))]
    if broken:
        evs.insert(1, '{"choices": [')
    evs.append("[DONE]")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", JSON_FALLBACK, json.dumps(evs)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if broken:
        assert got["status"] == "error" and got["error"].startswith("malformed JSON in stream event 2:"), got
    else:
        assert got == {"status": "ok", "error": "", "topk": [[7, 3, 11], [7, 3, 11]]}
