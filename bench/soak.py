"""Soak `tracekit serve`: many requests, clients that vanish, malformed bodies; nothing may leak.

Sends `--requests` requests (default 1,000) with at most `--concurrency` (32) in
flight against one engine. By a seeded draw each request is:

- malformed (5 %): bad JSON, JSON nested 50,000 deep, a lone surrogate, a seed
  of 2^64, max_tokens beyond the context, an id outside the vocabulary, a body
  over 1 MiB, wrong types, logprobs 21, an empty prompt. Each must get its 4xx;
- a client that disconnects (20 %): a stream dropped after k of its events
  (k drawn from 0 .. max_tokens-1: while queued, prefilling or decoding), or a
  non-streaming request whose socket is closed right after it is sent;
- a good request (the rest): streaming or not, greedy (checked token for token
  against a serial reference run first, FP32 being batch-exact) or seeded
  sampling, with or without logprobs / raw logits / a stop string taken from
  the reference text.

Afterwards: the engine is alive, /metrics returns to idle (leaked slots = busy
slots once the queue drained), its log holds no traceback, and its resident
memory (VmRSS of the engine process) grew less than 10 % between the first and
the last 200 completions (the max of each window). Disconnect moments are
counted in events, not seconds, so the run is the same on any machine.

Usage: python bench/soak.py [--quick] [--json] [--requests 1000] [--concurrency 32] [--slots 8] [--seed 0]
`--json` keys: sent, completed, cancelled, bad_inputs, lost, mismatched, leaked_slots, rss_growth, ...
`--quick`: 300 requests (well under two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.engine.process import start_engine  # noqa: E402

PROMPT_FILES = ("tiny.jsonl", "cpu_small.jsonl")
REF_TOKENS = 48  # reference length = the longest good request


def _ok(body: dict) -> bytes:
    return json.dumps({"prompt": "import os\n", "max_tokens": 4, "temperature": 0, **body}).encode()


BAD_BODIES: dict[str, tuple[bytes, int]] = {
    "malformed_json": (b'{"prompt": "import os", "max_tokens": 4', 400),
    "nested_50000": (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
    "lone_surrogate": (b'{"prompt": "abc\\ud800", "max_tokens": 4}', 400),
    "seed_2_64": (_ok({"temperature": 1.0, "seed": 2**64}), 400),
    "max_tokens_beyond_context": (_ok({"max_tokens": 10**9}), 400),
    "id_outside_vocab": (_ok({"prompt": [5, 10**7]}), 400),
    "body_over_1mib": (_ok({"prompt": "x" * (1 << 20)}), 413),
    "prompt_wrong_type": (_ok({"prompt": 5}), 400),
    "logprobs_21": (_ok({"logprobs": 21}), 400),
    "empty_prompt": (_ok({"prompt": ""}), 400),
}


def load_prompts() -> list:
    out = []
    for name in PROMPT_FILES:
        for line in (ROOT / "fixtures" / "prompts" / name).read_text().splitlines():
            if line.strip():
                out.append(json.loads(line)["prompt"])
    return out


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnects: dict = field(default_factory=dict)  # how -> count
    bad_inputs: int = 0
    bad_rejected: int = 0
    lost: int = 0  # good requests that did not complete (error, wrong shape, cut short)
    mismatched: int = 0  # greedy requests whose tokens differ from the serial reference
    problems: list = field(default_factory=list)  # the first few, with what happened
    rss_kb: list = field(default_factory=list)  # engine VmRSS after each finished request

    def problem(self, kind: str, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


async def reference(s: aiohttp.ClientSession, url: str, prompts: list) -> list[tuple[list[int], str]]:
    """Each prompt's greedy tokens and text, serially, before the load starts."""
    out = []
    for p in prompts:
        body = {"prompt": p, "max_tokens": REF_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            js = await r.json()
            if r.status != 200:
                raise SystemExit(f"reference request failed: HTTP {r.status} {js}")
            out.append((js["choices"][0]["token_ids"], js["choices"][0]["text"]))
    return out


def plan(n: int, seed: int, prompts: list, refs: list, disconnect: float, bad: float) -> list[dict]:
    """n request plans, drawn from one seeded generator."""
    rng, plans = random.Random(seed), []
    bad_names = sorted(BAD_BODIES)
    for i in range(n):
        u = rng.random()
        if u < bad:
            plans.append({"kind": "bad", "case": bad_names[i % len(bad_names)]})
            continue
        j = rng.randrange(len(prompts))
        body = {
            "prompt": prompts[j],
            "max_tokens": rng.randint(4, REF_TOKENS),
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": rng.random() < 0.6,
        }
        if rng.random() < 0.5:
            body["logprobs"] = rng.choice([0, 5, 20])
            body["return_raw_logits"] = rng.random() < 0.5
        if u < bad + disconnect:
            k = rng.randrange(body["max_tokens"])
            how = "drop_after_events" if rng.random() < 0.8 else "close_after_send"
            plans.append({"kind": "disconnect", "how": how, "events": k, "body": {**body, "stream": True}})
            continue
        if rng.random() < 0.15:
            body.update(temperature=1.0, seed=rng.randrange(2**32))
        elif rng.random() < 0.1:
            text = refs[j][1]
            a = rng.randrange(max(1, len(text) - 4))
            if text[a : a + 3].strip():
                body["stop"] = [text[a : a + 3]]
        plans.append({"kind": "good", "prompt": j, "body": body})
    return plans


async def read_stream(resp: aiohttp.ClientResponse, limit: int | None = None) -> tuple[list[int], str | None, bool]:
    """Token ids, finish reason and whether [DONE] came; stops after `limit` events when given."""
    ids, finish, done, events = [], None, False, 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
            break
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f"error event: {ev['error']}")
        for c in ev.get("choices", []):
            ids += c.get("token_ids", [])
            finish = c.get("finish_reason") or finish
        events += 1
        if limit is not None and events >= limit:
            break
    return ids, finish, done


async def run_good(s, url: str, p: dict, refs: list, t: Tally) -> None:
    b = p["body"]
    async with s.post(f"{url}/v1/completions", json=b) as r:
        if r.status != 200:
            t.lost += 1
            t.problem("good", f"HTTP {r.status}: {(await r.text())[:200]}")
            return
        if b["stream"]:
            ids, finish, done = await read_stream(r)
        else:
            js = await r.json()
            ids, finish, done = js["choices"][0]["token_ids"], js["choices"][0]["finish_reason"], True
    stopped = "stop" in b and finish == "stop"
    if not done or not ((len(ids) == b["max_tokens"] and finish == "length") or (stopped and len(ids) > 0)):
        t.lost += 1
        t.problem("good", f"{len(ids)}/{b['max_tokens']} tokens, finish {finish}, done {done}")
        return
    t.completed += 1
    if b["temperature"] == 0 and ids != refs[p["prompt"]][0][: len(ids)]:
        t.mismatched += 1
        t.problem("mismatch", f"prompt {p['prompt']}: {ids[:8]}... vs reference {refs[p['prompt']][0][:8]}...")


async def run_disconnect(s, url: str, p: dict, t: Tally) -> None:
    t.cancelled += 1
    t.disconnects[p["how"]] = t.disconnects.get(p["how"], 0) + 1
    if p["how"] == "close_after_send":
        host, port = url.removeprefix("http://").rsplit(":", 1)
        data = json.dumps(p["body"]).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        writer.close()
        return
    resp = await s.post(f"{url}/v1/completions", json=p["body"])
    try:
        if resp.status != 200:
            t.problem("disconnect", f"HTTP {resp.status}")
            return
        if p["events"]:
            await read_stream(resp, limit=p["events"])
    finally:
        resp.close()  # drops the connection mid-stream


async def run_bad(s, url: str, p: dict, t: Tally) -> None:
    t.bad_inputs += 1
    data, want = BAD_BODIES[p["case"]]
    async with s.post(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status == want:
            t.bad_rejected += 1
        else:
            t.problem("bad", f"{p['case']}: HTTP {r.status}, expected {want}")


async def metrics(s, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


async def wait_idle(s, url: str, hang_s: float = 120) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits (the loop frees a dropped slot within a step);
    hang_s only bounds a leak, which never frees."""
    deadline = time.monotonic() + hang_s
    while True:
        m = await metrics(s, url)
        idle = m["tracekit:num_requests_running"] == 0 and m["tracekit:num_requests_waiting"] == 0
        if idle and m["tracekit:slots_busy"] == 0 or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


async def soak(url: str, pid: int, log_path: str, n: int, concurrency: int, seed: int = 0) -> dict:
    """Run the soak against a live engine; returns the figures (see the module docstring)."""
    log_start = Path(log_path).stat().st_size
    t, t0 = Tally(), time.perf_counter()
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        prompts = load_prompts()
        refs = await reference(s, url, prompts)
        plans = plan(n, seed, prompts, refs, disconnect=0.2, bad=0.05)
        queue: asyncio.Queue = asyncio.Queue()
        for p in plans:
            queue.put_nowait(p)

        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                t.sent += 1
                try:
                    if p["kind"] == "good":
                        await run_good(s, url, p, refs, t)
                    elif p["kind"] == "bad":
                        await run_bad(s, url, p, t)
                    else:
                        await run_disconnect(s, url, p, t)
                except (aiohttp.ClientError, RuntimeError, OSError, asyncio.TimeoutError) as e:
                    if p["kind"] == "good":
                        t.lost += 1
                    t.problem(p["kind"], f"{type(e).__name__}: {e}")
                t.rss_kb.append(rss_kb(pid))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        m = await wait_idle(s, url)
        async with s.get(f"{url}/health") as r:
            healthy = r.status == 200
    log_tail = Path(log_path).read_bytes()[log_start:].decode(errors="replace")
    w = min(200, max(1, len(t.rss_kb) // 5))
    first, last = max(t.rss_kb[:w]), max(t.rss_kb[-w:])
    return {
        "sent": t.sent,
        "completed": t.completed,
        "cancelled": t.cancelled,
        "disconnects": t.disconnects,
        "bad_inputs": t.bad_inputs,
        "bad_inputs_rejected": t.bad_rejected,
        "lost": t.lost,
        "mismatched": t.mismatched,
        "leaked_slots": int(m["tracekit:slots_busy"]),
        "running_after": int(m["tracekit:num_requests_running"]),
        "waiting_after": int(m["tracekit:num_requests_waiting"]),
        "engine_alive": healthy,
        "tracebacks_in_log": log_tail.count("Traceback"),
        "engine_errors": int(m["tracekit:request_errors_total"]),
        "engine_cancelled": int(m["tracekit:requests_cancelled_total"]),
        "rss_first_mb": round(first / 1024, 1),
        "rss_last_mb": round(last / 1024, 1),
        "rss_growth": round(last / first - 1, 4),
        "rss_window": w,
        "concurrency": concurrency,
        "wall_s": round(time.perf_counter() - t0, 1),
        "problems": t.problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 requests")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--slots", default="8")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.requests or (300 if args.quick else 1000)
    with start_engine(["--threads", args.threads, "--slots", args.slots], timeout_s=300) as eng:
        res = asyncio.run(soak(eng.url, eng.pid, eng.log_path, n, args.concurrency, args.seed))
        res["engine_exit"] = eng.stop()
    ok = (
        res["lost"] == 0
        and res["mismatched"] == 0
        and res["leaked_slots"] == 0
        and res["engine_alive"]
        and res["tracebacks_in_log"] == 0
        and res["bad_inputs_rejected"] == res["bad_inputs"]
        and res["rss_growth"] < 0.10
    )
    res["ok"] = ok
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            if k != "problems":
                print(f"{k:22} {v}")
        for p in res["problems"]:
            print(f"  problem: {p}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
