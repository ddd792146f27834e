"""Capture soak: `tracekit capture` through a fault-injecting replay server; every request one row.

`--requests` streamed requests (default 2,000) at `--concurrency` (64) go through the real
command line (`python -m tracekit capture --http ... --json`, its own process) to the
transcript-replaying server of the tests (tests/support/replay.py, vLLM transcripts, each
response re-chunked at seeded byte boundaries). Each fault kind of the server is injected into
`--rate` (5 %) of the requests, exactly that many of each, placed by a seeded shuffle; the
rest are clean. What each kind must become (KINDS below):

- before any response byte: `drop` (the connection closed, once: the retry is served) is `ok`
  with its attempts recorded; `dropall` (closed every time) an `error` row after 3 attempts;
- mid-stream: `cut`, `cleancut`, `reset`, `nodone`, `badjson`, `badshape`, `errorevent`,
  `surrogate`, `badfinish` are `error` rows with HTTP 200; `stall` is a `timeout` row;
- refused: `500`, `400` are `error` rows with their HTTP status;
- `closeafter` (its connection closed after the response, keep-alive promised) and `slow`
  (the body in pieces 2 ms apart) are `ok`; a clean request that reused a closed
  connection is retried once and `ok`.

Checked: one row per planned key (`missing`, `duplicates`, `extra`), each with its kind's
status, HTTP status and error (`wrong_status`), the server saw each request as often as its kind
says (`wrong_sightings`), every `ok` row bitwise equal to the transcript (token ids, logprobs,
top-k, finish reason, cached tokens, prompt ids) and every failed row's tokens a bitwise prefix
of it (`wrong_tokens`), the command exits 1 (failed rows are in the trace) with counts that match
the trace's, and the capture process's resident memory (VmRSS, read from /proc at each request
the server receives) grows less than 10 % between the first and the last 400 requests
(`rss_growth`, the max of each window). The `stall` rows take `--timeout-s` (15 s) each: the only
clock in the run, a hang bound far beyond any
clean request (`ok_e2e_s`: the ok rows' send-to-last-byte percentiles).

Usage: python bench/capture_soak.py [--quick] [--json] [--requests 2000] [--concurrency 64] [--seed 0]
`--json` keys: requests, rows, missing, duplicates, extra, wrong_status, wrong_sightings,
wrong_tokens, retried, retried_after_reuse, exit_code, counts, kinds, rss_first_mb, rss_last_mb, rss_growth,
wall_s, ok_e2e_s, ok.
`--quick`: 500 requests (under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.replay import ReplayServer, load, routes_for  # noqa: E402

from tracekit.store import TraceReader  # noqa: E402

TOPK = 5
MAX_TOKENS = 12  # the vLLM transcript's length
TRANSCRIPT = "vllm__v1-completions__stream.http"
HANG_S = 1800  # the capture must end by then: a hang, not slowness


@dataclass(frozen=True)
class Expect:
    """What one kind of request must become: row status, HTTP status, a piece of its error,
    how many times the server sees it, and the attempts its row may record."""

    status: str
    http: int
    error: str = ""
    sightings: tuple = (1,)
    attempts: tuple = (1, 2)  # 2: the first attempt reused a connection the server had closed


KINDS = {  # "" = clean
    "": Expect("ok", 200),
    "500": Expect("error", 500, "injected failure"),
    "400": Expect("error", 400, "injected bad request"),
    "cut": Expect("error", 200, "Payload"),
    "cleancut": Expect("error", 200, "cut mid-event"),
    "reset": Expect("error", 200),
    "nodone": Expect("error", 200, "without [DONE]"),
    "badjson": Expect("error", 200, "malformed JSON"),
    "badshape": Expect("error", 200, "unexpected vllm response shape"),
    "errorevent": Expect("error", 200, "injected engine error"),
    "surrogate": Expect("error", 200, "not valid Unicode"),
    "badfinish": Expect("error", 200, "is not ASCII"),
    "stall": Expect("timeout", 200, "timeout"),
    # Attempt 1 may be lost to a closed kept-alive connection without the server seeing it;
    # attempts 2 and 3 go out on fresh connections and always arrive.
    "drop": Expect("ok", 200, "attempts, the connection failed before any response byte", (2,), (2, 3)),
    "dropall": Expect("error", -1, "3 attempts, the connection failed before any response byte", (2, 3), (3,)),
    "closeafter": Expect("ok", 200),
    "slow": Expect("ok", 200),
}
FAULTS = [k for k in KINDS if k]


def plan(n: int, seed: int, rate: float = 0.05) -> dict[str, str]:
    """{key: kind}: round(rate * n) requests of each fault kind, the rest clean, in seeded order."""
    per = round(rate * n)
    if per * len(FAULTS) > n:
        raise SystemExit(f"{n} requests cannot hold {per} of each of {len(FAULTS)} fault kinds")
    kinds = [k for k in FAULTS for _ in range(per)] + [""] * (n - per * len(FAULTS))
    random.Random(seed).shuffle(kinds)
    return {f"r{i:05d}": kind for i, kind in enumerate(kinds)}


def prompt_text(key: str, kind: str) -> str:
    """Distinct per key (the `drop` fault remembers texts); the server reads the kind from it."""
    return f"FAULT:{kind} {key}" if kind else f"def parse_args(argv): {key}\n    "


def key_of(text: str) -> str:
    return text.split()[-1]


@dataclass(frozen=True)
class Expected:
    """The transcript's answer as the trace must hold it."""

    token_id: np.ndarray  # [N] int32
    logprob: np.ndarray  # [N] float32
    topk_id: np.ndarray  # [N, k] int32
    topk_logprob: np.ndarray  # [N, k] float32
    prompt_ids: np.ndarray  # [P] int32
    finish_reason: str
    cached_tokens: int


def expected() -> Expected:
    """Read straight from the transcript's SSE events (not through the capture's dialect)."""
    ids, lps, tids, tlps, prompt, finish, cached = [], [], [], [], None, "", -1
    for ev in load(TRANSCRIPT).events():
        data = ev.strip().removeprefix(b"data: ")
        if data == b"[DONE]":
            continue
        obj = json.loads(data)
        cached = (obj.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", cached)
        for ch in obj["choices"]:
            prompt = ch["prompt_token_ids"] or prompt
            finish = ch["finish_reason"] or finish
            ids += ch["token_ids"]
            lps += ch["logprobs"]["token_logprobs"]
            for top in ch["logprobs"]["top_logprobs"]:
                tids.append([int(t.removeprefix("token_id:")) for t in top])
                tlps.append(list(top.values()))
    i32, f32 = np.int32, np.float32
    return Expected(
        np.array(ids, i32), np.array(lps, f32), np.array(tids, i32), np.array(tlps, f32),
        np.array(prompt, i32), finish, cached,
    )  # fmt: skip


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise: same shape, dtype and bytes (NaN pads compare equal, -0.0 does not equal 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def tokens_right(r: TraceReader, i: int, exp: Expected, kind: str) -> str:
    """'' when row i holds the transcript's answer as its kind allows; else what differs. An `ok`
    row: all of it. A `badfinish` row: every token, no finish reason and no cached count (what
    docs/capture.md says such a row keeps). Any other row: a prefix of the tokens. Prompt ids,
    where a row has them, are the transcript's."""
    rec, t, pids = r.record(i), r.tokens(i), r.prompt_ids(i)
    n, whole = len(t.token_id), rec.status == "ok" or kind == "badfinish"
    if n > len(exp.token_id) or (whole and n != len(exp.token_id)):
        return f"{n} tokens, the transcript has {len(exp.token_id)}"
    for name in ("token_id", "logprob", "topk_id", "topk_logprob"):
        if not _same(getattr(t, name), getattr(exp, name)[:n]):
            return f"{name} differs"
    if pids is not None and not _same(pids.astype(np.int32), exp.prompt_ids):
        return "prompt ids differ"
    if rec.status == "ok" and (
        pids is None or (rec.finish_reason, rec.cached_tokens) != (exp.finish_reason, exp.cached_tokens)
    ):
        return f"finish {rec.finish_reason!r}, cached {rec.cached_tokens}, prompt ids {pids is not None}"
    if kind == "badfinish" and (rec.finish_reason, rec.cached_tokens) != ("", -1):
        return f"finish {rec.finish_reason!r}, cached {rec.cached_tokens}"
    return ""


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return -1


class SampledServer(ReplayServer):
    """The replay server, reading the capture process's VmRSS each time a request arrives
    (counted in requests, not seconds: the windows mean the same on any machine)."""

    pid: int | None = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rss_kb: list[int] = []

    async def _handle(self, request):
        if self.pid is not None and request.method == "POST":
            kb = rss_kb(self.pid)
            if kb > 0:
                self.rss_kb.append(kb)
        return await super()._handle(request)


def capture_cmd(url: str, prompts: Path, out: Path, concurrency: int, timeout_s: float) -> list[str]:
    return [
        sys.executable, "-m", "tracekit", "capture", "--http", url, "--prompts", str(prompts),
        "--out", str(out), "--concurrency", str(concurrency), "--max-tokens", str(MAX_TOKENS),
        "--top-logprobs", str(TOPK), "--timeout-s", str(timeout_s), "--json",
    ]  # fmt: skip


def run_capture(kinds: dict, work: Path, concurrency: int, timeout_s: float, seed: int):
    """Send the planned requests through `tracekit capture`; (exit code, its JSON summary,
    the server's POST bodies, RSS samples, wall seconds, stderr)."""
    prompts = work / "soak.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": prompt_text(k, v)}) + "\n" for k, v in kinds.items()))
    out = work / "soak.h5"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with SampledServer(routes_for("vllm"), seed=seed) as srv:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            capture_cmd(srv.url, prompts, out, concurrency, timeout_s),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        srv.pid = p.pid
        stdout, stderr = p.communicate(timeout=HANG_S)
        wall = time.perf_counter() - t0
        seen = [q["body"]["prompt"] for q in srv.requests if q["path"] == "/v1/completions"]
        rss = list(srv.rss_kb)
    summary = json.loads(stdout) if stdout.strip().startswith("{") else {}
    return p.returncode, summary, seen, rss, wall, stderr, out


def attempts_of(error: str) -> int:
    m = re.search(r"(\d+) attempts, the connection failed", error)
    return int(m.group(1)) if m else 1


def check_rows(out: Path, kinds: dict, seen: list[str]) -> dict:
    """Per key: exactly one row, the kind's status, sightings and attempts, right tokens."""
    exp = expected()
    sightings = Counter(key_of(t) for t in seen)
    res = {
        "wrong_status": [],
        "wrong_sightings": [],
        "wrong_tokens": [],
        "retried": 0,
        "retried_after_reuse": 0,
        "status_by_key": {},
    }
    with TraceReader(out) as r:
        keys = list(r.requests.key)
        per_key = Counter(keys)
        res["rows"] = len(keys)
        res["missing"] = sorted(set(kinds) - set(per_key))
        res["duplicates"] = sorted(k for k, c in per_key.items() if c > 1)
        res["extra"] = sorted(set(per_key) - set(kinds))
        res["trace_counts"] = dict(Counter(r.requests.status))
        for i, key in enumerate(keys):
            if key not in kinds:
                continue
            kind, rec = kinds[key], r.record(i)
            res["status_by_key"][key] = (rec.status, rec.http_status)
            e, n = KINDS[kind], attempts_of(rec.error)
            res["retried"] += n > 1
            res["retried_after_reuse"] += n > 1 and kind not in ("drop", "dropall")  # lost to a closed connection
            if (rec.status, rec.http_status) != (e.status, e.http) or e.error not in rec.error or n not in e.attempts:
                res["wrong_status"].append(
                    f"{key} ({kind or 'clean'}): {rec.status} HTTP {rec.http_status}, {n} attempts: {rec.error[:160]}"
                )
            if sightings[key] not in e.sightings:
                res["wrong_sightings"].append(f"{key} ({kind or 'clean'}): the server saw it {sightings[key]} times")
            why = tokens_right(r, i, exp, kind)
            if why:
                res["wrong_tokens"].append(f"{key} ({kind or 'clean'}): {why}")
    return res


def soak(n: int, concurrency: int, seed: int = 0, timeout_s: float = 15.0, work: Path | None = None) -> dict:
    """Run the soak; returns the figures (module docstring). `work`: where the trace goes."""
    kinds = plan(n, seed)
    with tempfile.TemporaryDirectory(prefix="capture-soak-") as tmp:
        work = Path(work or tmp)
        code, summary, seen, rss, wall, stderr, out = run_capture(kinds, work, concurrency, timeout_s, seed)
        if not out.exists():
            raise SystemExit(f"the capture wrote no trace (exit {code}): {stderr[-2000:]}")
        res = check_rows(out, kinds, seen)
    w = min(400, max(1, len(rss) // 5))
    first, last = max(rss[:w]), max(rss[-w:])
    want = Counter(KINDS[k].status for k in kinds.values())
    counts = summary.get("counts", {})
    return {
        "requests": n,
        **res,
        "exit_code": code,
        "counts": counts,
        "counts_expected": {s: want.get(s, 0) for s in ("ok", "error", "timeout", "cancelled")},
        "counts_match_trace": all(counts.get(s, 0) == res["trace_counts"].get(s, 0) for s in set(counts)),
        "kinds": {k or "clean": c for k, c in sorted(Counter(kinds.values()).items())},
        "server_requests": len(seen),
        "rss_first_mb": round(first / 1024, 1),
        "rss_last_mb": round(last / 1024, 1),
        "rss_growth": round(last / first - 1, 4),
        "rss_window": w,
        "rss_samples": len(rss),
        "concurrency": concurrency,
        "timeout_s": timeout_s,
        "wall_s": round(wall, 1),
        "capture_wall_s": summary.get("wall_s"),
        "ok_e2e_s": summary.get("latency", {}).get("e2e_s"),
        "tracebacks": stderr.count("Traceback"),
    }


LISTS = ("missing", "duplicates", "extra", "wrong_status", "wrong_sightings", "wrong_tokens")


def passed(res: dict) -> bool:
    return (
        not (res["missing"] or res["duplicates"] or res["extra"])
        and not (res["wrong_status"] or res["wrong_sightings"] or res["wrong_tokens"])
        and res["rows"] == res["requests"]
        and res["exit_code"] == 1
        and res["counts"] == res["counts_expected"]
        and res["counts_match_trace"]
        and res["tracebacks"] == 0
        and res["rss_growth"] < 0.10
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 requests")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=15.0, help="the capture's --timeout-s (the stall rows)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.requests or (500 if args.quick else 2000)
    res = soak(n, args.concurrency, args.seed, args.timeout_s)
    res["ok"] = passed(res)
    problems = []
    for name in LISTS:  # counts in the output; the first few entries under `problems`
        problems += [f"{name}: {x}" for x in res[name]]
        res[name] = len(res[name])
    res["problems"] = problems[:20]
    del res["status_by_key"]  # one entry a request: for the tests, not the summary
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:22} {v}")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
