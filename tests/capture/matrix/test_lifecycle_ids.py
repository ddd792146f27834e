"""cancel_then_match compares token ids as ints (capture/matrix/lifecycle.py).

An engine that sends vLLM's "token_id:N" strings and no `token_ids` leaves strings in the
accumulator; compared as they are, they never equal the baseline's ints and a healthy engine
failed the check. The ids now go through the accumulator's resolution; an engine whose ids
stay unknown (token strings only) is skipped with the reason, never compared as equal -1s.
Real sockets (the replay server)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from support.replay import ReplayServer, routes_for

from tracekit.capture import dialects
from tracekit.capture.client import Clock, make_session, send
from tracekit.capture.dialects import RequestSpec
from tracekit.capture.matrix.lifecycle import _match, _outcome_view


def _drop_token_ids(doc: bytes) -> bytes:
    obj = json.loads(doc)
    for ch in obj.get("choices") or ():
        ch.pop("token_ids", None)
    return json.dumps(obj).encode()


def _without_token_ids(routes: dict) -> dict:
    """vLLM's transcripts minus `token_ids`: the chosen ids only as "token_id:N" strings."""
    route = ("POST", "/v1/completions")
    new = {}
    for kind, t in routes[route].items():
        if kind == "stream":
            events = [e.strip()[len(b"data: ") :] for e in t.events()]
            body = b"".join(b"data: " + (e if e == b"[DONE]" else _drop_token_ids(e)) + b"\n\n" for e in events)
        else:
            body = _drop_token_ids(t.body)
        assert b'"token_ids"' not in body
        new[kind] = dataclasses.replace(t, body=body)
    return {**routes, route: new}


async def _twice(url: str, dialect: str, spec: RequestSpec) -> list:
    async with make_session(1, 30) as session:
        d, clock = dialects.get(dialect), Clock()
        return [await send(session, url, d, spec, clock) for _ in range(2)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_ids_sent_as_token_id_strings_match_the_baseline(stream):
    spec = RequestSpec("p", "def parse_args(argv):\n    ", 12, 5, False, stream)
    with ReplayServer(_without_token_ids(routes_for("vllm"))) as srv:
        (o1, acc1), (o2, acc2) = asyncio.run(_twice(srv.url, "vllm", spec))
    before, after = _outcome_view(o1, acc1), _outcome_view(o2, acc2)
    assert all(type(t) is int and t >= 0 for t in after["token_ids"]) and len(after["token_ids"]) == 12
    baseline = {"key": "p", "cached_tokens": after["cached_tokens"], "token_ids": list(after["token_ids"])}
    check = _match(before, after, baseline, acc1.lps, acc2.lps)
    assert check.status == "pass", check.summary
    assert check.evidence["first_difference_vs_baseline"] is None


def test_unknown_ids_are_not_compared():
    """A strings-only engine: -1 ids everywhere; equal -1s prove nothing, so the check says so."""
    spec = RequestSpec("p", "def parse_args(argv):\n    ", 12, 5, False, True)
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        (o1, acc1), (o2, acc2) = asyncio.run(_twice(srv.url, "openai", spec))
    before, after = _outcome_view(o1, acc1), _outcome_view(o2, acc2)
    assert after["token_ids"] == [-1] * 12
    check = _match(before, after, None, acc1.lps, acc2.lps)
    assert check.status == "skip" and "token ids unknown" in check.summary
