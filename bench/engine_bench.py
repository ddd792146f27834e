"""Throughput of `tracekit serve` by client concurrency: does batched decode really batch?

Starts the engine (fixture model, --slots 8, prefix cache off so only batching
is measured), sends the same greedy requests (ignore_eos, fixed length) at each
concurrency level side by side in one run, and prints generated tokens/s.
`speedup_c8` = tokens/s at concurrency 8 / tokens/s serial (target >= 3).
The mean decode batch comes from the engine's own /metrics (rows / steps).

Usage: python bench/engine_bench.py [--quick] [--json] [--dtype fp32|bf16] [--threads 1] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracekit.engine.process import start_engine  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "fixtures" / "prompts" / "tiny.jsonl"


def bodies(n: int, max_tokens: int) -> list[dict]:
    ps = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()]
    return [{"prompt": ps[i % len(ps)], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for i in range(n)]


async def metrics(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


async def level(url: str, reqs: list[dict], concurrency: int) -> dict:
    """Send reqs with at most `concurrency` in flight; tokens/s over the whole wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        m0 = await metrics(s, url)

        async def one(b):
            async with sem, s.post(f"{url}/v1/completions", json=b) as r:
                js = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {js}")
                return js["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(b) for b in reqs)))
        wall = time.perf_counter() - t0
        m1 = await metrics(s, url)
    steps = m1["tracekit:decode_steps_total"] - m0["tracekit:decode_steps_total"]
    rows = m1["tracekit:decode_rows_total"] - m0["tracekit:decode_rows_total"]
    busy = m1["tracekit:engine_busy_seconds_total"] - m0["tracekit:engine_busy_seconds_total"]
    return {"concurrency": concurrency, "requests": len(reqs), "tokens": toks, "wall_s": round(wall, 3),
            "tokens_per_s": round(toks / wall, 1), "mean_decode_batch": round(rows / max(steps, 1), 2),
            "engine_busy_frac": round(busy / wall, 3), "ms_per_step": round(1e3 * busy / max(steps, 1), 2)}


async def run(url: str, levels: list[int], n: int, max_tokens: int) -> list[dict]:
    reqs = bodies(n, max_tokens)
    await level(url, reqs[:2], 2)  # warm-up: first forwards allocate
    return [await level(url, reqs, c) for c in levels]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (< 1 minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="engine torch threads")
    ap.add_argument("--url", default=None, help="bench an engine already running (with >= 8 slots)")
    a = ap.parse_args()
    levels = [1, 8] if a.quick else [1, 2, 4, 8]
    n, max_tokens = (16, 48) if a.quick else (32, 128)
    if a.url:
        rows, engine_args = asyncio.run(run(a.url.rstrip("/"), levels, n, max_tokens)), None
    else:
        engine_args = ["--slots", "8", "--no-prefix-cache", "--dtype", a.dtype, "--threads", str(a.threads)]
        with start_engine(engine_args) as eng:
            rows = asyncio.run(run(eng.url, levels, n, max_tokens))
    by_c = {r["concurrency"]: r for r in rows}
    out = {"speedup_c8": round(by_c[8]["tokens_per_s"] / by_c[1]["tokens_per_s"], 2),
           "tokens_per_s_serial": by_c[1]["tokens_per_s"], "tokens_per_s_c8": by_c[8]["tokens_per_s"],
           "levels": rows, "requests": n, "max_tokens": max_tokens, "dtype": a.dtype,
           "engine_args": engine_args, "quick": a.quick}
    if a.json:
        print(json.dumps(out))
        return
    from tabulate import tabulate
    print(tabulate(rows, headers="keys"))
    print(f"speedup_c8 = {out['speedup_c8']} (target >= 3)")


if __name__ == "__main__":
    main()
