"""Capture client overhead: tracekit's HTTP capture vs a bare aiohttp SSE reader.

A local aiohttp server (a separate process, so the client's CPU time is its
own) streams pre-built vLLM-style SSE events (`token_id:N` strings, top-20
logprobs, `token_ids`, vLLM 0.33's explicit nulls, usage, `[DONE]`) as fast as
it can. At concurrency 1, 16 and 64 the same requests are read by
- bare: one ClientSession, `iter_any()`, events split on blank lines, no parsing;
- tracekit: `tracekit.capture.http.run_capture` with the vllm dialect, top-20 logprobs
  parsed, columns built and appended to an HDF5 trace after each request.
Two more rows put the ratio in context: bare-lines reads line by line
(`async for line in resp.content`, as vLLM's and SGLang's benchmark clients
do) and bare+json adds one json.loads per event to the bare reader and nothing
else: the floor of any client that parses what it stores; bare+orjson does the
same with orjson.loads, the parser tracekit uses when orjson is installed (the
row is left out without it).
Reported: client CPU seconds per 1,000 tokens (getrusage of this process,
user + system) and tokens/s; `cpu_per_token_vs_bare_c64` = tracekit / bare at
concurrency 64 (target <= 1.3, issue 25), `json_floor_vs_bare_c64` = bare+json / bare,
`orjson_floor_vs_bare_c64` = bare+orjson / bare; `json_parser` says which parser
tracekit used.

    python bench/capture_bench.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import orjson
except ImportError:  # the parsing-floor row with orjson is left out
    orjson = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOPK = 20


# ---- server (child process) ---------------------------------------------------------------
def build_events(n_tokens: int, seed: int = 0) -> bytes:
    """One request's whole SSE body: n token events, a usage event, [DONE]."""
    rng = random.Random(seed)
    out = []
    for i in range(n_tokens):
        ids = rng.sample(range(32000), TOPK)
        # The top 20 of a distribution: their probabilities sum to at most 1 (a row summing above
        # it is a misreport that every check of the writer takes its slow path on).
        w = [math.exp(-rng.random() * 8) for _ in ids]
        scale = rng.uniform(0.3, 0.99) / sum(w)
        lps = sorted((math.log(x * scale) for x in w), reverse=True)
        ch = {
            "index": 0,
            "text": f" w{ids[0]}",
            "logprobs": {
                "text_offset": [i * 4],
                "token_logprobs": [lps[0]],
                "tokens": [f"token_id:{ids[0]}"],
                "top_logprobs": [{f"token_id:{t}": lp for t, lp in zip(ids, lps)}],
            },
            "finish_reason": "length" if i == n_tokens - 1 else None,
            "stop_reason": None,
            # vLLM 0.33 sends these on every chunk, null where they carry nothing: the prompt ids
            # on the first chunk only, weight versions on the last only.
            "prompt_token_ids": list(range(16)) if i == 0 else None,
            "token_ids": [ids[0]],
            "weight_versions": None,
        }
        out.append(
            {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 1,
                "model": "bench",
                "choices": [ch],
                "usage": None,
            }
        )
    out.append(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1,
            "model": "bench",
            "choices": [],
            "usage": {
                "prompt_tokens": 16,
                "completion_tokens": n_tokens,
                "total_tokens": 16 + n_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in out) + b"data: [DONE]\n\n"


def serve(port_file: str, n_tokens: int) -> None:
    from aiohttp import web

    body = build_events(n_tokens)
    # Split at event boundaries: one write per event, as an engine streams them.
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model", "owned_by": "vllm"}]})

    async def completions(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if request.path.startswith("/coalesced/"):
            await resp.write(body)  # the whole response at once: one or two TCP reads client-side
        else:
            for e in events:
                await resp.write(e)
                # Let the event go out before the next one, as an engine emits one event per
                # decode step; back-to-back writes would coalesce into a few big TCP segments.
                await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        for prefix in ("", "/coalesced"):
            app.router.add_get(prefix + "/v1/models", models)
            app.router.add_post(prefix + "/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        Path(port_file).write_text(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- clients -------------------------------------------------------------------------------
async def bare_client(url: str, n_requests: int, concurrency: int, mode: str = "chunks", loads=json.loads) -> int:
    """Read every stream and count token events. mode "chunks": `iter_any()` and split on
    blank lines (the leanest reader); "lines": `async for line in resp.content`, as the
    vLLM / SGLang benchmark clients read SSE; "json": chunks plus one json.loads per
    event and nothing else (the floor of any client that parses the events)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True})

    async def one(session) -> int:
        n, buf = 0, b""
        async with (
            sem,
            session.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r,
        ):
            if mode == "lines":
                async for line in r.content:
                    line = line.strip()
                    if line:
                        n += 1
                return n - 2
            async for chunk in r.content.iter_any():
                parts = (buf + chunk).split(b"\n\n")
                buf = parts.pop()
                n += len(parts)
                if mode == "json":
                    for p in parts:
                        if p != b"data: [DONE]":
                            loads(p[6:])
        return n - 2  # minus the usage event and [DONE]

    async with aiohttp.ClientSession(connector=conn) as s:
        counts = await asyncio.gather(*(one(s) for _ in range(n_requests)))
    return sum(counts)


def tracekit_client(url: str, n_requests: int, concurrency: int, tmp: Path) -> int:
    from tracekit.capture.http import CaptureConfig, run_capture

    prompts = tmp / f"p{concurrency}.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": [1, 2, 3]}) + "\n" for i in range(n_requests)))
    out = tmp / f"t{concurrency}.h5"
    s = run_capture(
        CaptureConfig(
            url=url,
            prompts=str(prompts),
            out=str(out),
            concurrency=concurrency,
            top_logprobs=TOPK,
            dialect="vllm",
            progress=False,
        )
    )
    assert s.failed == 0, s
    out.unlink()
    return s.tokens


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(fn) -> tuple[float, float, int]:
    c0, w0 = cpu_s(), time.perf_counter()
    tokens = fn()
    return cpu_s() - c0, time.perf_counter() - w0, tokens


def run(quick: bool) -> dict:
    n_tokens = 128 if quick else 256
    plan = {1: 8, 16: 48, 64: 128} if quick else {1: 32, 16: 192, 64: 512}
    tmp = Path(tempfile.mkdtemp(prefix="capture_bench_"))
    port_file = tmp / "port"
    srv = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), "--tokens", str(n_tokens)])
    try:
        deadline = time.time() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.time() > deadline or srv.poll() is not None:
                raise SystemExit("bench server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        # Warm-up: imports (h5py, numpy, capture) and the first connections, outside the timings.
        tracekit_client(url, 4, 2, tmp)
        for mode in ("chunks", "lines", "json"):
            asyncio.run(bare_client(url, 4, 2, mode))
        rows = []
        for regime, base in (("per-event", url), ("coalesced", url + "/coalesced")):
            for c, n in plan.items():
                for name, fn in (
                    ("bare", lambda: asyncio.run(bare_client(base, n, c))),
                    ("bare-lines", lambda: asyncio.run(bare_client(base, n, c, "lines"))),
                    ("bare+json", lambda: asyncio.run(bare_client(base, n, c, "json"))),
                    *(
                        [("bare+orjson", lambda: asyncio.run(bare_client(base, n, c, "json", orjson.loads)))]
                        if orjson
                        else []
                    ),
                    ("tracekit", lambda: tracekit_client(base, n, c, tmp)),
                ):
                    cpu, wall, tokens = measure(fn)
                    assert tokens == n * n_tokens, (name, tokens)
                    rows.append(
                        {
                            "regime": regime,
                            "client": name,
                            "concurrency": c,
                            "requests": n,
                            "tokens": tokens,
                            "cpu_s": round(cpu, 4),
                            "wall_s": round(wall, 4),
                            "cpu_s_per_1k_tokens": round(1000 * cpu / tokens, 5),
                            "tokens_per_s": round(tokens / wall, 1),
                        }
                    )
    finally:
        srv.terminate()
        srv.wait(10)
    by = {(r["regime"], r["client"], r["concurrency"]): r["cpu_s_per_1k_tokens"] for r in rows}
    ratios = {}
    for regime, tag in (("per-event", ""), ("coalesced", "coalesced_")):
        for c in plan:
            ratios[f"{tag}cpu_per_token_vs_bare_c{c}"] = round(by[regime, "tracekit", c] / by[regime, "bare", c], 3)
        for c in plan:
            ratios[f"{tag}cpu_per_token_vs_bare_lines_c{c}"] = round(
                by[regime, "tracekit", c] / by[regime, "bare-lines", c], 3
            )
        for c in plan:  # the floor: json.loads alone on top of the leanest reader
            ratios[f"{tag}json_floor_vs_bare_c{c}"] = round(by[regime, "bare+json", c] / by[regime, "bare", c], 3)
        for c in plan if orjson else ():
            ratios[f"{tag}orjson_floor_vs_bare_c{c}"] = round(by[regime, "bare+orjson", c] / by[regime, "bare", c], 3)
    return {
        "bench": "capture",
        "quick": quick,
        "tokens_per_request": n_tokens,
        "topk": TOPK,
        "json_parser": "orjson" if orjson else "json",
        **ratios,
        "target_cpu_per_token_vs_bare_c64": 1.3,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="tracekit capture client overhead vs a bare SSE reader")
    ap.add_argument("--quick", action="store_true", help="fewer requests (< 1 minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tokens)
        return
    res = run(args.quick)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    from tabulate import tabulate

    print(
        tabulate(
            [
                [
                    r["regime"],
                    r["client"],
                    r["concurrency"],
                    r["requests"],
                    r["tokens"],
                    r["cpu_s_per_1k_tokens"],
                    r["tokens_per_s"],
                ]
                for r in res["rows"]
            ],
            headers=["regime", "client", "conc", "requests", "tokens", "CPU s / 1k tok", "tok/s"],
        )
    )
    for k, v in res.items():
        if "_vs_bare" in k:
            print(f"{k}: {v}" + ("  (target <= 1.3)" if k == "cpu_per_token_vs_bare_c64" else ""))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
