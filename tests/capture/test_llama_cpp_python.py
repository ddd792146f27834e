"""llama-cpp-python's server (issue 24, items 7 and 8), over the replay server with its recorded
transcripts: recognised as its own engine (owned_by "me", served by uvicorn); every request sends
neutral penalties (its server applies repeat_penalty 1.1 by default: 12/12 pairs unexplained
against llama-server); an EOS it sends as '' in top_logprobs maps to no id and is counted per row
and warned, never dropped silently."""

from __future__ import annotations

import dataclasses
import json

from support.capture_helpers import TOKENIZER
from support.replay import ReplayServer, routes_for

from tracekit.store import TraceReader

X = [{"id": "a", "prompt": "def parse_args(argv):\n    "}]


def _with_empty_candidate(routes: dict) -> dict:
    """The non-stream answer with its first top-k row's last candidate renamed '' (the EOS as
    llama-cpp-python sends it: the empty detokenized string)."""
    route = ("POST", "/v1/completions")
    t = routes[route]["nonstream"]
    head, sep, body = t.body.partition(b"\r\n\r\n") if b"\r\n\r\n" in t.body else (b"", b"", t.body)
    doc = json.loads(body)
    row = doc["choices"][0]["logprobs"]["top_logprobs"][0]
    last = list(row)[-1]
    row[""] = row.pop(last)
    new = dataclasses.replace(t, body=head + sep + json.dumps(doc).encode())
    return {**routes, route: {**routes[route], "nonstream": new}}


def test_recognised_and_sent_neutral_penalties(capture_to):
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        s, out = capture_to(srv.url, X, name="lcp.h5", tokenizer=TOKENIZER, stream=False)
        bodies = [r["body"] for r in srv.requests if r["path"] == "/v1/completions"]
    assert s.failed == 0
    with TraceReader(out) as r:
        run = r.meta.run
    assert run["engine_family"] == "llama-cpp-python" and run["dialect"] == "openai"
    assert run["engine"]["neutral_penalties"]["repeat_penalty"] == 1.0
    assert bodies and all(b["repeat_penalty"] == 1.0 and b["presence_penalty"] == 0.0 for b in bodies), bodies


def test_an_eos_sent_as_empty_string_is_counted_and_warned(capture_to, capsys):
    with ReplayServer(_with_empty_candidate(routes_for("llama-cpp-python"))) as srv:
        s, out = capture_to(srv.url, X, name="lcp-eos.h5", tokenizer=TOKENIZER, stream=False)
    err = capsys.readouterr().err
    assert s.failed == 0 and s.unknown_topk_entries == 1 and s.unknown_id_tokens == 0
    assert "topk_ids_unknown" in s.pitfalls and "llama-cpp-python sends an EOS as ''" in err
    assert "tokenizer_mismatch" not in s.pitfalls  # the chosen tokens all mapped: the tokenizer is right
    with TraceReader(out) as r:
        rec, tok = r.record(0), r.tokens(0)
    assert rec.status == "ok" and "1 top-k candidates in 1 of 12 positions have no id" in rec.error, rec.error
    assert (tok.topk_id[0] == -1).sum() == 1 and (tok.topk_id[1:] >= 0).all()
