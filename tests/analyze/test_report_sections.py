"""The matrix report shows what each burst capture recorded about itself (analyze/run_report_sections.py):
prefix reuse per request where the engine reports cached tokens, else its /metrics hit counter over
the capture (run.prefix_cache_counters), and the pitfalls the captures warned of, once each with the
cells they apply to. The whole page against a real run is tests/capture/matrix/test_run_e2e.py."""

from __future__ import annotations

from tracekit.analyze.run_report_sections import pitfalls, reuse

COUNTERS = {"family": "vllm", "hits": "vllm:prefix_cache_hits_total", "hits_delta": 96.0, "queries_delta": 200.0}


def test_reuse_is_per_request_where_reported_else_the_engine_counter():
    assert reuse({"requests": 8, "cached_reported": 8, "reused": 5, "counters": COUNTERS}) == "5/8 req"
    assert reuse({"requests": 8, "cached_reported": 0, "reused": 0, "counters": COUNTERS}) == "96/200 tok (/metrics)"
    no_queries = dict(COUNTERS, queries_delta=None)
    assert reuse({"requests": 8, "cached_reported": 0, "reused": 0, "counters": no_queries}) == "96 tok (/metrics)"
    unknown = {"family": None, "hits_delta": None, "queries_delta": None, "why": "the engine serves no /metrics"}
    assert reuse({"requests": 8, "cached_reported": 0, "reused": 0, "counters": unknown}) == "?"
    assert reuse({}) == ""  # no burst trace


def test_pitfalls_are_listed_once_with_their_cells():
    p = {"code": "no_cached_tokens", "message": "no per-request cached tokens (...)"}
    q = {"code": "eos_unknown", "message": "EOS ids unknown (...)"}
    lines = pitfalls([("c1", {"pitfalls": [p]}), ("c2", {"pitfalls": [p, q]}), ("c3", {})])
    assert lines[0] == "### Pitfalls warned at capture"
    assert "- `no_cached_tokens` (c1, c2): no per-request cached tokens (...)" in lines
    assert "- `eos_unknown` (c2): EOS ids unknown (...)" in lines
    assert pitfalls([("c1", {"pitfalls": []})]) == []
