"""The fault-injection family (tracekit/engine/faults.py SPECS): each kind does what it claims.

bench/sensitivity.py --family measures which of these bugs `tracekit diff` catches; that figure
only means something if each fault really changes what it says (the batched-only kinds nothing in
a serial run, the reporting kinds only the reported field) and magnitude 0 is exactly the healthy
engine. Faulty engines are real `tracekit serve` processes on 127.0.0.1; the magnitude-0 checks run
the same owner loop in process (one model load for all kinds), serial and batched.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
from support.engine_helpers import greedy, run_concurrent, run_serial

from tracekit.engine.faults import SPECS, Fault, parse_fault
from tracekit.errors import ConfigError

MAX_TOKENS = 12
TAG = [100 + b for b in uuid.uuid4().bytes]  # 16 ids unique to this module: no hits from other tests
HEADER = TAG + list(range(300, 332))  # 3 blocks of 16


def _prompts() -> list[list[int]]:
    """p0 and p1 share the 3-block header (p1 hits 48), p2 differs from the header only in the last 4
    ids of block 3 (hits 32; 48 under prefix-key-collision:4), p3 is short (different length in a batch)."""
    return [
        HEADER + list(range(400, 420)),
        HEADER + list(range(500, 505)),
        HEADER[:44] + [7, 8, 9, 10] + list(range(600, 610)),
        TAG + list(range(700, 708)),
    ]


def _bodies() -> list[dict]:
    return [greedy(p, MAX_TOKENS, logprobs=3, return_raw_logits=True) for p in _prompts()]


def _get(url: str, path: str) -> dict:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url + path) as r:
            return await r.json()

    return asyncio.run(go())


def _ids(r):
    return r["choices"][0]["token_ids"]


def _lp(r):
    return r["choices"][0]["logprobs"]["token_logprobs"]


def _cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def _gap(a, b) -> float:
    """Largest |Δ chosen logprob| over the common length; inf when the tokens differ."""
    if _ids(a) != _ids(b):
        return float("inf")
    return max(abs(x - y) for x, y in zip(_lp(a), _lp(b)))


@pytest.fixture(scope="module")
def healthy(engine) -> list[dict]:
    """The serial pass on the default healthy engine (FP32, 4 slots, prefix cache on)."""
    return run_serial(engine.url, _bodies())


def _faulty(engine_factory, text: str, *extra: str) -> tuple[list[dict], list[dict]]:
    """(serial pass, then a concurrent burst of the same prompts) on an engine with the fault; checks
    that /v1/models names the canonical fault."""
    eng = engine_factory("--inject-fault", text, *extra)
    assert _get(eng.url, "/v1/models")["data"][0]["meta"]["inject_fault"] == parse_fault(text).name
    serial = run_serial(eng.url, _bodies())
    return serial, run_concurrent(eng.url, _bodies(), 4)


def test_every_kind_parses_with_its_default_and_canonical_name():
    """Each family kind takes `kind` (its documented default) and `kind:MAG`; bad magnitudes are
    refused naming the knob, and the spelling /v1/models reports is canonical."""
    family = [s for s in SPECS.values() if s.default is not None]
    assert len(family) >= 10
    for s in family:
        assert parse_fault(s.kind) == Fault(s.kind, float(s.default))
        assert s.models and "#" in s.models  # names the real issue it imitates
    assert parse_fault("kv-row-swap:1").name == "kv-row-swap:1.0"
    assert parse_fault("hit-position-offset:2").name == "hit-position-offset:2"
    assert parse_fault("batch-scale").name == "batch-scale:0.001"
    for bad in ("early-stop:1.5", "open-pad-column:1.5", "batch-scale:-1", "cached-tokens-off:x"):
        with pytest.raises(ConfigError, match="must be"):
            parse_fault(bad)


@pytest.mark.parametrize("text", ["batch-scale:0.05", "open-pad-column:1", "kv-row-swap:1", "wrong-row-sample:1"])
def test_batched_path_faults_leave_serial_runs_alone(engine_factory, healthy, text):
    """Batched-path bugs (scale, padding mask, KV row, sampled row) change nothing in a batch of
    one (serial is bitwise healthy) and change the burst far beyond FP32 noise (~1e-5 nats)."""
    serial, burst = _faulty(engine_factory, text)
    assert [_lp(r) for r in serial] == [_lp(r) for r in healthy]
    assert max(_gap(b, h) for b, h in zip(burst, healthy)) > 1e-3


def test_prefix_key_collision_serves_another_prompts_kv(engine_factory, healthy):
    """A block hash that ignores the last 4 tokens lets p2 reuse the header's third block although
    its last 4 ids differ: one block more reported cached, and the output changes."""
    serial, _ = _faulty(engine_factory, "prefix-key-collision:4")
    assert (_cached(healthy[2]), _cached(serial[2])) == (32, 48)
    assert _gap(serial[2], healthy[2]) > 1e-3
    assert [_lp(r) for r in serial[:2]] == [_lp(r) for r in healthy[:2]]


def test_prefix_use_after_free_corrupts_later_hits(engine_factory, healthy):
    """p1's hit frees the header's third block while it stays mapped; p2's new block is written into
    its storage; the burst's hits on the header then read p2's KV. The serial pass itself (each hit
    copies its blocks at admission) is healthy."""
    serial, burst = _faulty(engine_factory, "prefix-use-after-free:16")
    assert [_lp(r) for r in serial] == [_lp(r) for r in healthy]
    assert _gap(burst[0], healthy[0]) > 1e-3 and _gap(burst[1], healthy[1]) > 1e-3


def test_hit_position_offset_moves_only_requests_after_a_hit(engine_factory, healthy):
    serial, _ = _faulty(engine_factory, "hit-position-offset:1")
    assert _cached(serial[0]) == 0 and _lp(serial[0]) == _lp(healthy[0])
    assert _cached(serial[1]) == 48 and _gap(serial[1], healthy[1]) > 1e-3


def test_chunk_boundary_loses_kv_at_each_chunk_boundary(engine_factory, healthy):
    """With --prefill-chunk 8, zeros at the position before each chunk boundary: far beyond the
    ~1e-6 that chunking itself moves FP32 logprobs."""
    serial, _ = _faulty(engine_factory, "chunk-boundary:1", "--prefill-chunk", "8")
    assert _gap(serial[0], healthy[0]) > 1e-3


def test_topk_misorder_swaps_the_first_two_and_nothing_else(engine_factory, healthy):
    serial, _ = _faulty(engine_factory, "topk-misorder:1")
    for got, want in zip(serial, healthy):
        assert _ids(got) == _ids(want) and _lp(got) == _lp(want)
        g, w = (r["choices"][0]["logprobs"]["top_token_ids"] for r in (got, want))
        assert all(a[:2] == b[1::-1] and a[2:] == b[2:] for a, b in zip(g, w))


def test_stale_logprobs_reports_the_previous_step(engine_factory, healthy):
    serial, _ = _faulty(engine_factory, "stale-logprobs:1")
    for got, want in zip(serial, healthy):
        assert _ids(got) == _ids(want)
        assert _lp(got) == [_lp(want)[0], *_lp(want)[:-1]]


def test_cached_tokens_off_misreports_only_the_count(engine_factory, healthy):
    serial, _ = _faulty(engine_factory, "cached-tokens-off:1")
    assert [_cached(r) for r in serial] == [c + 1 if c else 0 for c in map(_cached, healthy)]
    assert [_lp(r) for r in serial] == [_lp(r) for r in healthy]


def test_early_stop_ends_requests_with_stop_before_max_tokens(engine_factory, healthy):
    serial, _ = _faulty(engine_factory, "early-stop:0.2")
    short = [(g, w) for g, w in zip(serial, healthy) if len(_ids(g)) < MAX_TOKENS]
    assert short, "P = 0.2 over 12 tokens x 4 requests should stop one early"
    for g, w in short:
        assert g["choices"][0]["finish_reason"] == "stop" and _ids(g) == _ids(w)[: len(_ids(g))]


# ---- magnitude 0 is bitwise the healthy engine (in process, serial and batched) -------------


@pytest.fixture(scope="module")
def executor():
    from tracekit.engine.executor import ModelExecutor, default_model_dir

    return ModelExecutor(default_model_dir(), "fp32", slots=4)


def _run_in_process(executor, text: str | None, chunk: int) -> list:
    """Serial pass then all prompts at once (batched decode): every event's numbers and the reported
    cached_tokens, per request."""
    from tracekit.engine.engine import Engine, GenRequest
    from tracekit.engine.faults_hooks import engine_fault
    from tracekit.engine.prefix_cache import PrefixCache

    fault = parse_fault(text)
    executor.fault = hooks = engine_fault(fault)
    executor.drop_batch()
    eng = Engine(executor, PrefixCache(16, 4096, fault), prefill_chunk=chunk, fault=hooks)
    out = []
    for serial in (True, False):
        events = [[] for _ in _prompts()]
        reqs = [
            GenRequest(p, MAX_TOKENS, logprobs=3, ignore_eos=True, emit=e.append) for p, e in zip(_prompts(), events)
        ]
        for r in reqs:
            eng.submit(r)
            if serial:
                eng.run_until_idle()
        eng.run_until_idle()
        out += [(evs, r.cached_tokens_reported) for evs, r in zip(events, reqs)]
    executor.fault = None
    return out


@pytest.mark.parametrize("kind", [k for k, s in SPECS.items() if s.knob is not None])
def test_magnitude_zero_is_bitwise_healthy(executor, kind):
    """`kind:0` runs every hook and must leave every token, logprob, top-k entry, finish reason and
    reported cached_tokens exactly as the healthy engine has them: the sweep's zero is truly zero."""
    chunk = 8 if SPECS[kind].needs == "prefill_chunk" else 0
    assert _run_in_process(executor, f"{kind}:0", chunk) == _run_in_process(executor, None, chunk)
