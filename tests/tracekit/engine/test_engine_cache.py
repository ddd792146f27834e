"""Prefix-cache reporting: cached_tokens in usage and the /metrics counters agree."""

from __future__ import annotations

import asyncio
import uuid

from support.engine_helpers import greedy, metric, run_serial


def test_second_request_reports_cached_prefix(engine):
    """The second of two requests sharing a long prefix must report the reused block-aligned
    prefix in usage.prompt_tokens_details.cached_tokens, and /metrics must count the same hit."""
    # A unique header, so earlier tests cannot have cached it.
    header = f"# {uuid.uuid4().hex}\n" + "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n" * 3
    q0, h0 = (
        metric(engine.url, "tracekit:prefix_cache_queries_total"),
        metric(engine.url, "tracekit:prefix_cache_hits_total"),
    )
    first, second = run_serial(
        engine.url, [greedy(header + "        self.path = path\n", 4), greedy(header + "    def read(self):\n", 4)]
    )
    c1 = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    c2 = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert c1 == 0
    assert c2 >= 32 and c2 % 16 == 0
    assert c2 < second["usage"]["prompt_tokens"]
    hits = metric(engine.url, "tracekit:prefix_cache_hits_total") - h0
    queries = metric(engine.url, "tracekit:prefix_cache_queries_total") - q0
    assert hits == c2
    assert queries == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]


def test_fault_switch_corrupts_reused_prefix(engine_factory):
    """--inject-fault corrupt-prefix-cache must change outputs after a prefix hit in FP32 (where
    nothing else can), so the analysis can be shown to catch a real block-ownership bug."""
    clean = engine_factory("--no-prefix-cache")
    faulty = engine_factory("--inject-fault", "corrupt-prefix-cache")
    header = "def first(a, b):\n    return a + b\n\n\ndef second(x):\n    return x * 2\n\n\n"
    other = "class Other:\n    value = 1\n\n    def method(self):\n        return self.value\n\n\n"
    bodies = [greedy(other + "x = 1\n", 16), greedy(header + "def third(", 16), greedy(header + "def fourth(", 32)]
    want = run_serial(clean.url, bodies)
    got = run_serial(faulty.url, bodies)
    assert got[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert got[1]["choices"][0]["token_ids"] == want[1]["choices"][0]["token_ids"]  # no hit, no fault
    assert got[2]["choices"][0]["token_ids"] != want[2]["choices"][0]["token_ids"]


DOCUMENTED = [
    "num_requests_running",
    "num_requests_waiting",
    "slots_busy",
    "slots_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prefix_cache_blocks",
    "prompt_tokens_total",
    "generation_tokens_total",
    "requests_cancelled_total",
    "request_errors_total",
    "prefill_forwards_total",
    "decode_steps_total",
    "decode_rows_total",
    "engine_busy_seconds_total",
]


async def _burst_and_watch(url: str, n: int) -> tuple[list[int], int, int]:
    """Send n long requests at once; return their token counts and the peak running / waiting gauges."""
    import aiohttp

    peak_run = peak_wait = 0
    async with aiohttp.ClientSession() as s:

        async def one():
            async with s.post(f"{url}/v1/completions", json=greedy("import os\n", 200)) as r:
                return (await r.json())["usage"]["completion_tokens"]

        tasks = [asyncio.ensure_future(one()) for _ in range(n)]
        while not all(t.done() for t in tasks):
            async with s.get(f"{url}/metrics") as r:
                vals = {
                    ln.split()[0]: float(ln.split()[1])
                    for ln in (await r.text()).splitlines()
                    if ln and not ln.startswith("#")
                }
            peak_run = max(peak_run, int(vals["tracekit:num_requests_running"]))
            peak_wait = max(peak_wait, int(vals["tracekit:num_requests_waiting"]))
            await asyncio.sleep(0.01)
        return [t.result() for t in tasks], peak_run, peak_wait


def test_requests_beyond_slots_wait_in_queue(engine):
    """With 4 slots, 8 simultaneous requests run 4 at a time and the other 4 wait (the gauges show
    it), and all 8 complete in full; every documented metric name is exported."""
    counts, peak_run, peak_wait = asyncio.run(_burst_and_watch(engine.url, 8))
    assert counts == [200] * 8
    assert peak_run == 4 and peak_wait >= 1
    for name in DOCUMENTED:
        metric(engine.url, f"tracekit:{name}")  # raises KeyError when missing
