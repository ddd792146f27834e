"""Lifecycle checks read each engine family's /metrics by exact name (issue 13): vLLM,
SGLang, TGI, llama.cpp and tracekit serve are recognised; a suffix never matches
(vLLM's external_prefix_cache_hits_total is not the engine's hits); a check whose
metric the engine lacks is `skip` with the reason. The drain check runs against a
real /metrics server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from aiohttp import web

from tracekit.capture.client import make_session
from tracekit.capture.matrix.lifecycle import _drain, prefix_cache_check, reuse_check
from tracekit.capture.metrics import delta, family_of, parse_metrics, prefix_counters
from tracekit.schema import RequestTable

SAMPLES = {
    "tracekit": "tracekit:num_requests_running 0\ntracekit:num_requests_waiting 0\n"
    "tracekit:prefix_cache_hits_total 64\ntracekit:requests_cancelled_total 3\ntracekit:slots_busy 0\n",
    "vllm": 'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
    'vllm:prefix_cache_hits_total{model_name="m"} 96.0\nvllm:prefix_cache_queries_total{model_name="m"} 200.0\n',
    "sglang": 'sglang:num_running_reqs{tp_rank="0"} 0.0\nsglang:num_queue_reqs{tp_rank="0"} 0.0\n'
    'sglang:cached_tokens_total{tp_rank="0"} 512.0\n',
    "tgi": "tgi_queue_size 0\ntgi_batch_current_size 0\ntgi_request_count 12\n",
    "llamacpp": "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"
    "llamacpp:prompt_tokens_cached_total 40\n",
}


def test_parse_metrics_sums_labelled_series():
    text = (
        "# HELP x\ntracekit:num_requests_running 2\n"
        'tracekit:requests_finished_total{finished_reason="stop"} 3\n'
        'tracekit:requests_finished_total{finished_reason="length"} 4\n'
    )
    m = parse_metrics(text)
    assert m["tracekit:requests_finished_total"] == 7 and m["tracekit:num_requests_running"] == 2


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_family_is_recognised_by_its_exact_names(name):
    assert family_of(parse_metrics(SAMPLES[name])).name == name


def test_a_suffix_never_matches_another_counter():
    """vLLM with only a KV-connector's external hits: the engine's own reuse counter is absent,
    so there is no reuse delta (the old suffix match read the connector's hits as the engine's)."""
    text = "vllm:num_requests_running 0\nvllm:external_prefix_cache_hits_total 50\n"
    before = parse_metrics(text)
    after = parse_metrics(text.replace(" 50", " 80"))
    fam = family_of(after)
    assert fam.name == "vllm" and delta(before, after, fam.reuse) is None
    check = reuse_check(_fill(2, [-1, -1]), True, prefix_counters(before, after))
    assert check.status == "skip" and "vllm:prefix_cache_hits_total" in check.summary


def _fill(n: int, cached: list[int]) -> RequestTable:
    """A burst's request table of n ok rows with these cached_tokens."""
    cols = {}
    for f in dataclasses.fields(RequestTable):
        cols[f.name] = np.array(["ok"] * n, dtype=object) if f.name == "status" else np.zeros(n)
    cols["cached_tokens"] = np.array(cached)
    return RequestTable(**cols)


def test_reuse_counter_of_each_family_decides_prefix_cache_without_cached_tokens():
    """SGLang and llama.cpp count cached prompt tokens; with no per-request cached_tokens
    the check passes on that counter moving."""
    for name, counter in (
        ("sglang", "sglang:cached_tokens_total"),
        ("llamacpp", "llamacpp:prompt_tokens_cached_total"),
    ):
        before = parse_metrics(SAMPLES[name])
        after = dict(before, **{counter: before[counter] + 32})
        check = reuse_check(_fill(2, [-1, -1]), True, prefix_counters(before, after))
        assert check.status == "pass" and f"{counter} +32" in check.summary, check


@pytest.mark.parametrize(
    "name,queries",
    [
        ("tracekit", {"tracekit:prefix_cache_queries_total": 100}),
        ("vllm", {"vllm:prefix_cache_queries_total": 100}),
        ("sglang", {"sglang:prompt_tokens_total": 100}),  # every prompt token, the cached ones included
        ("llamacpp", {"llamacpp:prompt_tokens_total": 68}),  # the processed ones only: + the 32 cached
    ],
)
def test_prefix_counters_give_hits_and_queries_in_tokens(name, queries):
    """What a capture records around itself (run.prefix_cache_counters): 32 prompt tokens reused
    of 100 looked up, on every family's own names."""
    before = {**parse_metrics(SAMPLES[name]), **dict.fromkeys(queries, 1000.0)}
    fam = family_of(before)
    after = {**before, fam.reuse: before[fam.reuse] + 32, **{k: 1000.0 + v for k, v in queries.items()}}
    c = prefix_counters(before, after)
    assert (c["family"], c["hits"], c["hits_delta"], c["queries_delta"]) == (name, fam.reuse, 32, 100), c
    check = reuse_check(_fill(2, [-1, -1]), True, c)
    assert check.status == "pass" and "+32 of 100 prompt tokens looked up" in check.summary


def test_no_metrics_or_no_family_is_said():
    assert prefix_counters(None, None) == {
        "family": None,
        "hits_delta": None,
        "queries_delta": None,
        "why": "the engine serves no /metrics",
    }
    check = reuse_check(_fill(2, [-1, -1]), True, prefix_counters(None, None))
    assert check.status == "skip" and "the engine serves no /metrics" in check.summary


def test_tgi_without_a_reuse_counter_is_skipped_with_the_reason():
    m = parse_metrics(SAMPLES["tgi"])
    check = reuse_check(_fill(2, [-1, -1]), True, prefix_counters(m, m))
    assert check.status == "skip" and "no prefix-reuse counter" in check.summary


def test_prefix_cache_off_fails_when_reuse_is_reported():
    check = prefix_cache_check(_fill(2, [0, 16]), False, None, None)
    assert check.status == "fail" and "1/2 requests reported reuse" in check.summary


async def _serve(text: str):
    async def metrics(_request):
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _drain_against(text: str):
    async def go():
        runner, url = await _serve(text)
        try:
            async with make_session(2, 10) as s:
                return await _drain(s, url, 1.0, None)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


@pytest.mark.parametrize("name", ["sglang", "tgi", "llamacpp", "vllm"])
def test_cancel_drain_reads_each_familys_gauges(name):
    check = _drain_against(SAMPLES[name])
    fam = family_of(parse_metrics(SAMPLES[name]))
    assert check.status == "pass" and check.evidence["family"] == name and fam.running in check.summary


def test_cancel_drain_fails_when_the_family_gauge_stays_busy():
    check = _drain_against(
        SAMPLES["sglang"].replace('num_running_reqs{tp_rank="0"} 0.0', 'num_running_reqs{tp_rank="0"} 2')
    )
    assert check.status == "fail" and "still 2 running" in check.summary


def test_cancel_drain_skips_an_unknown_engine_with_the_reason():
    check = _drain_against("my_engine_running 0\n")
    assert check.status == "skip" and "no name of a known engine family" in check.summary
    assert "my_engine_running" in check.summary
