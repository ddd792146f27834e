"""Throughput of `tracekit serve` by client concurrency: does batched decode really batch?

Starts the engine (fixture model, --slots 8, prefix cache off so only batching
is measured), sends the same greedy requests (ignore_eos, fixed length) at each
concurrency level side by side in one run (levels interleaved over --repeats
rounds, fastest round per level), and prints generated tokens/s.
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
    return [
        {"prompt": ps[i % len(ps)], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for i in range(n)
    ]


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
    return {
        "concurrency": concurrency,
        "requests": len(reqs),
        "tokens": toks,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(toks / wall, 1),
        "mean_decode_batch": round(rows / max(steps, 1), 2),
        "engine_busy_frac": round(busy / wall, 3),
        "ms_per_step": round(1e3 * busy / max(steps, 1), 2),
    }


async def run(url: str, levels: list[int], n: int, max_tokens: int, repeats: int) -> list[dict]:
    """Levels interleaved, `repeats` rounds; each level keeps its fastest round (the machine may be
    shared: the best round is the one least disturbed by others)."""
    reqs = bodies(n, max_tokens)
    await level(url, reqs[:2], 2)  # warm-up: first forwards allocate
    best: dict[int, dict] = {}
    for _ in range(repeats):
        for c in levels:
            r = await level(url, reqs, c)
            if c not in best or r["tokens_per_s"] > best[c]["tokens_per_s"]:
                best[c] = r
    return [dict(best[c], rounds=repeats) for c in levels]


def engine_only(levels: list[int], n: int, max_tokens: int, dtype: str, threads: int) -> list[dict]:
    """The same workload through the owner loop in-process, no HTTP: what batching alone buys."""
    import torch

    from tracekit.engine.engine import Engine, GenRequest
    from tracekit.engine.executor import ModelExecutor, default_model_dir

    torch.set_num_threads(threads)
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    eng = Engine(ModelExecutor(default_model_dir(), dtype, slots=8), None)
    tok = eng.executor.tokenizer
    prompts = [tok.encode(b["prompt"], add_special_tokens=False) for b in bodies(n, max_tokens)]
    out = []
    for c in levels:
        t0, done = time.perf_counter(), 0
        for i in range(0, n, c):  # waves of c requests, as the HTTP client's semaphore allows
            for p in prompts[i : i + c]:
                eng.submit(GenRequest(prompt_ids=p, max_tokens=max_tokens, ignore_eos=True, emit=lambda ev: None))
            eng.run_until_idle()
            done += len(prompts[i : i + c]) * max_tokens
        wall = time.perf_counter() - t0
        out.append({"concurrency": c, "tokens_per_s": round(done / wall, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (< 1 minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="engine torch threads")
    ap.add_argument("--url", default=None, help="bench an engine already running (with >= 8 slots)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the fastest per level counts")
    a = ap.parse_args()
    levels = [1, 8] if a.quick else [1, 2, 4, 8]
    n, max_tokens = (16, 48) if a.quick else (32, 128)
    if a.url:
        rows, engine_args = asyncio.run(run(a.url.rstrip("/"), levels, n, max_tokens, a.repeats)), None
    else:
        engine_args = ["--slots", "8", "--no-prefix-cache", "--dtype", a.dtype, "--threads", str(a.threads)]
        with start_engine(engine_args) as eng:
            rows = asyncio.run(run(eng.url, levels, n, max_tokens, a.repeats))
    by_c = {r["concurrency"]: r for r in rows}
    eo = (
        {}
        if a.url
        else {r["concurrency"]: r["tokens_per_s"] for r in engine_only([1, 8], n, max_tokens, a.dtype, a.threads)}
    )
    out = {
        "speedup_c8": round(by_c[8]["tokens_per_s"] / by_c[1]["tokens_per_s"], 2),
        "tokens_per_s_serial": by_c[1]["tokens_per_s"],
        "tokens_per_s_c8": by_c[8]["tokens_per_s"],
        "engine_only_speedup_c8": round(eo[8] / eo[1], 2) if eo else None,
        "engine_only_tokens_per_s": eo,
        "levels": rows,
        "requests": n,
        "max_tokens": max_tokens,
        "dtype": a.dtype,
        "engine_args": engine_args,
        "quick": a.quick,
        "repeats": a.repeats,
    }
    if a.json:
        print(json.dumps(out))
        return
    from tabulate import tabulate

    print(tabulate(rows, headers="keys"))
    print(f"speedup_c8 = {out['speedup_c8']} (target >= 3); in-process without HTTP: {out['engine_only_speedup_c8']}")


if __name__ == "__main__":
    main()
