#!/usr/bin/env python3
"""No request lost to the transport: consecutive captures against a real `llama-server -np 4`.

    python scripts/llama_soak.py [--runs 20] [--concurrency 2,4,8] [--mode after|before|keepalive-retry] [--json]

Starts llama-server (TRACEKIT_LLAMA_SERVER, or the build script's cache) on the fixture model (f32
GGUF), then for each concurrency runs `--runs` consecutive captures of fixtures/prompts/cpu_small.jsonl
(8 token-id prompts x `--repeat`, 32 tokens, --dialect auto) and counts, per concurrency: requests
planned, ok, lost (planned - ok), and requests that needed a second attempt.

Modes (the transport, issue 13): `after` is tracekit as shipped (no keep-alive for llama.cpp,
retry on a fresh connection when a connection fails before any response byte); `before` is the
transport before the fix (keep-alive, no retry); `keepalive-retry` keeps connections alive and
retries (how many retries keep-alive would cost). Exit 1 when a request was lost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp import ROOT, server_binary, start_server, tiny_gguf  # noqa: E402

from tracekit.capture import client, probe  # noqa: E402
from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402
from tracekit.store import TraceReader  # noqa: E402

PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"


def _mode(mode: str) -> None:
    if mode in ("before", "keepalive-retry"):
        probe.KEEP_ALIVE = {}  # every engine kept alive, llama.cpp included
    if mode == "before":
        client.ATTEMPTS = 1


def soak(url: str, concurrency: int, runs: int, repeat: int, work: Path) -> dict:
    planned = ok = retried = 0
    errors: Counter = Counter()
    t0 = time.perf_counter()
    for i in range(runs):
        out = work / f"c{concurrency}-{i}.h5"
        cfg = CaptureConfig(
            url=url,
            prompts=str(PROMPTS),
            out=str(out),
            concurrency=concurrency,
            max_tokens=32,
            top_logprobs=5,
            ignore_eos=True,
            repeat=repeat,
            progress=False,
        )
        s = run_capture(cfg)
        planned += s.planned
        ok += s.counts["ok"]
        with TraceReader(out) as r:
            for j in range(len(r)):
                rec = r.record(j)
                retried += "attempts" in rec.error
                if rec.status != "ok":
                    errors[rec.error[:90]] += 1
        out.unlink()
    return {
        "concurrency": concurrency,
        "captures": runs,
        "requests": planned,
        "ok": ok,
        "lost": planned - ok,
        "retried": retried,
        "errors": dict(errors),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--concurrency", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=2, help="each capture sends the 8 prompts this many times")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--mode", choices=("after", "before", "keepalive-retry"), default="after")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    binary = server_binary()
    if not binary:
        print(
            "Error: no llama-server: run scripts/build_llama_server.sh, export TRACEKIT_LLAMA_SERVER", file=sys.stderr
        )
        return 3
    _mode(a.mode)
    with tempfile.TemporaryDirectory(prefix="tk-llama-soak-") as tmp:
        work = Path(tmp)
        with start_server(binary, tiny_gguf(work), slots=a.slots, log_path=str(work / "server.log")) as eng:
            rows = [soak(eng.url, int(c), a.runs, a.repeat, work) for c in a.concurrency.split(",")]
    result = {"mode": a.mode, "server": f"llama-server -np {a.slots}", "rows": rows}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"mode {a.mode}, llama-server -np {a.slots}")
        for r in rows:
            print(
                f"  c={r['concurrency']}: {r['captures']} captures, {r['ok']}/{r['requests']} ok, "
                f"lost {r['lost']}, retried {r['retried']}, {r['wall_s']} s  {r['errors'] or ''}"
            )
    return 1 if any(r["lost"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
