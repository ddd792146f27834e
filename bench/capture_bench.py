"""Capture client overhead: tracekit's HTTP capture vs a bare aiohttp SSE reader.

A local aiohttp server (bench/capture_server.py, a separate process, so the client's CPU time is its
own) streams pre-built vLLM-style SSE events (`token_id:N` strings, top-20
logprobs, `token_ids`, vLLM 0.33's explicit nulls, usage, `[DONE]`) in three
regimes: per-event (one write an event, as fast as the server can: the
headline), coalesced (a whole response in one write) and stepped (an engine's
decode step: every STEP_S each running stream gets its next event, all at
once, far below either client's capacity). The same requests are read by
- bare: one ClientSession, `iter_any()`, events split on blank lines, no parsing;
- tracekit: `tracekit.capture.http.run_capture` with the vllm dialect, top-20 logprobs
  parsed, columns built and appended to an HDF5 trace after each request.
More rows put the ratio in context: bare-lines reads line by line
(`async for line in resp.content`, as vLLM's and SGLang's benchmark clients
do); bare+json adds one json.loads per event to the bare reader and nothing
else (the floor of any client that parses what it stores); bare+orjson does the
same with orjson.loads, the parser tracekit uses when orjson is installed (the
row is left out without it); bare+keep also keeps the chosen id, its logprob
and the top-k candidates in lists, inline (the floor of any Python client that
keeps what it parses); tracekit-read is tracekit's own stream reader
(session, SSE fast path, parse, the dialect's event handling into the
accumulator) with no columns and no trace, which splits tracekit's cost
between parsing and storing.
Reported: client CPU seconds per 1,000 tokens (getrusage of this process,
user + system) and tokens/s. At c=64 the clients take turns `--reps` times and
each ratio is the median of the turns' ratios (`<key>_range`: their spread):
`cpu_per_token_vs_bare_c64` = tracekit / bare, per-event (target <= 1.3,
issue 25); `stepped_cpu_per_token_vs_bare_c64` the same in the stepped regime;
`*_orjson_floor_*` = bare+orjson / bare, `*_keep_floor_*` = bare+keep / bare,
`*_read_vs_bare_c64` = tracekit-read /
bare; `json_parser` says which parser tracekit used.

    python bench/capture_bench.py [--quick] [--reps N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_server import STEP_S, TOPK  # noqa: E402


# ---- clients -------------------------------------------------------------------------------
async def bare_client(url: str, n_requests: int, concurrency: int, mode: str = "chunks", loads=json.loads) -> int:
    """Read every stream and count token events. mode "chunks": `iter_any()` and split on
    blank lines (the leanest reader); "lines": `async for line in resp.content`, as the
    vLLM / SGLang benchmark clients read SSE; "json": chunks plus one json.loads per
    event and nothing else (the floor of any client that parses the events); "keep": orjson
    and the chosen id, its logprob and the top-k candidates kept in lists, inline, with no
    check and no function call (the floor of any Python client that keeps what it parses)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True})

    async def one(session) -> int:
        n, buf = 0, b""
        ids, lps, keys, vals = [], [], [], []  # "keep": what a client that stores the top-k keeps
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
                elif mode == "keep":
                    for p in parts:
                        if p != b"data: [DONE]":
                            ch = loads(p[6:])["choices"]
                            if ch:
                                lp = ch[0]["logprobs"]
                                tops = lp["top_logprobs"][0]
                                ids.append(ch[0]["token_ids"][0])
                                lps.append(lp["token_logprobs"][0])
                                keys.extend(tops)
                                vals.extend(tops.values())
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


def tracekit_read_client(url: str, n_requests: int, concurrency: int) -> int:
    """tracekit's stream reader alone: its session, SSE fast path, JSON parse and the vllm
    dialect's event handling into the accumulator; no columns, no trace (where tracekit's own
    cost splits between parsing and storing)."""
    from tracekit.capture.client import Clock, _read_stream, make_session
    from tracekit.capture.dialects import Acc
    from tracekit.capture.dialects.openai import VLLMCompletions

    dialect = VLLMCompletions()
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True})

    async def main() -> int:
        sem, clock = asyncio.Semaphore(concurrency), Clock()
        async with make_session(concurrency, 600.0) as s:

            async def one() -> int:
                acc = Acc()
                async with (
                    sem,
                    s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r,
                ):
                    await _read_stream(r, dialect, acc, clock)
                return len(acc.lps)

            return sum(await asyncio.gather(*(one() for _ in range(n_requests))))

    return asyncio.run(main())


def _clients(base: str, n: int, c: int, tmp: Path, names: tuple[str, ...]) -> list:
    every = {
        "bare": lambda: asyncio.run(bare_client(base, n, c)),
        "bare-lines": lambda: asyncio.run(bare_client(base, n, c, "lines")),
        "bare+json": lambda: asyncio.run(bare_client(base, n, c, "json")),
        "bare+orjson": lambda: asyncio.run(bare_client(base, n, c, "json", orjson.loads)),
        "bare+keep": lambda: asyncio.run(bare_client(base, n, c, "keep", orjson.loads)),
        "tracekit-read": lambda: tracekit_read_client(base, n, c),
        "tracekit": lambda: tracekit_client(base, n, c, tmp),
    }
    return [(name, every[name]) for name in names if orjson or name not in ("bare+orjson", "bare+keep")]


BASE = ("bare", "bare-lines", "bare+json", "bare+orjson", "tracekit")  # at every concurrency
ALL = BASE[:-1] + ("bare+keep", "tracekit-read", "tracekit")  # at c=64: where the cost splits
STEPPED = ("bare", "bare+orjson", "bare+keep", "tracekit-read", "tracekit")


def run(quick: bool, reps: int | None = None) -> dict:
    n_tokens = 128 if quick else 256
    plan = {1: 8, 16: 48, 64: 96} if quick else {1: 32, 16: 192, 64: 512}
    stepped_n = 64 if quick else 256  # c=64: one wave of requests quick, four full
    reps = reps or (2 if quick else 3)
    # A stepped pass lasts as long as its steps whatever the client (~0.7 s a wave quick): quick
    # runs it once and without bare+keep, to stay within a quarter of a minute.
    stepped = (STEPPED if not quick else tuple(c for c in STEPPED if c != "bare+keep"), reps if not quick else 1)
    tmp = Path(tempfile.mkdtemp(prefix="capture_bench_"))
    port_file = tmp / "port"
    server = Path(__file__).with_name("capture_server.py")
    srv = subprocess.Popen([sys.executable, str(server), str(port_file), "--tokens", str(n_tokens)])
    try:
        deadline = time.time() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.time() > deadline or srv.poll() is not None:
                raise SystemExit("bench server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        # Warm-up: imports (h5py, numpy, capture) and the first connections, outside the timings.
        tracekit_client(url, 4, 2, tmp)
        tracekit_read_client(url, 4, 2)
        for mode in ("chunks", "lines", "json"):
            asyncio.run(bare_client(url, 4, 2, mode))
        # (regime, concurrency, requests, clients, repetitions). At c=64 the clients take turns
        # `reps` times: this host's speed drifts by tens of percent within a minute, so each
        # ratio is taken between neighbours in time and the median of those is reported.
        passes = [
            (regime, c, n, ALL if c == 64 else BASE, reps if c == 64 else 1)
            for regime in ("per-event", "coalesced")
            for c, n in plan.items()
        ]
        passes += [("stepped", 64, stepped_n, *stepped)]
        prefix = {"per-event": "", "coalesced": "/coalesced", "stepped": "/stepped"}
        rows = []
        for regime, c, n, names, times in passes:
            for rep in range(times):
                for name, fn in _clients(url + prefix[regime], n, c, tmp, names):
                    cpu, wall, tokens = measure(fn)
                    assert tokens == n * n_tokens, (name, tokens)
                    rows.append(
                        {
                            "regime": regime,
                            "client": name,
                            "concurrency": c,
                            "requests": n,
                            "rep": rep,
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
    return {
        "bench": "capture",
        "quick": quick,
        "tokens_per_request": n_tokens,
        "topk": TOPK,
        "json_parser": "orjson" if orjson else "json",
        "reps_c64": reps,
        "stepped_step_ms": STEP_S * 1000,
        **ratios(rows, plan),
        "target_cpu_per_token_vs_bare_c64": 1.3,
        "rows": rows,
    }


def ratios(rows: list[dict], plan: dict) -> dict:
    """Each ratio per repetition (client / bare of the same pass), its median as the figure and,
    where there are several, their range as `<key>_range`."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["regime"], r["concurrency"], r["rep"]), {})[r["client"]] = r["cpu_s_per_1k_tokens"]
    out: dict = {}

    def put(key: str, regime: str, c: int, num: str, den: str = "bare") -> None:
        got = [
            v[num] / v[den] for (g, cc, _), v in sorted(by.items()) if g == regime and cc == c and num in v and den in v
        ]
        if not got:
            return
        got.sort()
        mid = len(got) // 2
        out[key] = round(got[mid] if len(got) % 2 else (got[mid - 1] + got[mid]) / 2, 3)
        if len(got) > 1:
            out[key + "_range"] = [round(got[0], 3), round(got[-1], 3)]

    for regime, tag in (("per-event", ""), ("coalesced", "coalesced_")):
        for c in plan:
            put(f"{tag}cpu_per_token_vs_bare_c{c}", regime, c, "tracekit")
        for c in plan:
            put(f"{tag}cpu_per_token_vs_bare_lines_c{c}", regime, c, "tracekit", "bare-lines")
        for c in plan:  # the floor: json.loads alone on top of the leanest reader
            put(f"{tag}json_floor_vs_bare_c{c}", regime, c, "bare+json")
        for c in plan:
            put(f"{tag}orjson_floor_vs_bare_c{c}", regime, c, "bare+orjson")
        put(f"{tag}keep_floor_vs_bare_c64", regime, 64, "bare+keep")
        put(f"{tag}read_vs_bare_c64", regime, 64, "tracekit-read")
    put("stepped_cpu_per_token_vs_bare_c64", "stepped", 64, "tracekit")
    put("stepped_orjson_floor_vs_bare_c64", "stepped", 64, "bare+orjson")
    put("stepped_keep_floor_vs_bare_c64", "stepped", 64, "bare+keep")
    put("stepped_read_vs_bare_c64", "stepped", 64, "tracekit-read")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="tracekit capture client overhead vs a bare SSE reader")
    ap.add_argument("--quick", action="store_true", help="fewer requests (< 1 minute)")
    ap.add_argument("--reps", type=int, help="turns each client takes at c=64 (default 3, 2 with --quick)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    res = run(args.quick, args.reps)
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
                    r["rep"],
                    r["tokens"],
                    r["cpu_s_per_1k_tokens"],
                    r["tokens_per_s"],
                ]
                for r in res["rows"]
            ],
            headers=["regime", "client", "conc", "requests", "rep", "tokens", "CPU s / 1k tok", "tok/s"],
        )
    )
    for k, v in res.items():
        if "_vs_bare" in k and not k.endswith("_range"):
            rng = res.get(k + "_range")
            print(
                f"{k}: {v}"
                + (f" (per turn {rng[0]}-{rng[1]})" if rng else "")
                + ("  (target <= 1.3)" if k == "cpu_per_token_vs_bare_c64" else "")
            )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
