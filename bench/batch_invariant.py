"""`tracekit serve --batch-invariant`: serial vs concurrent BF16, bitwise, and what it costs.

For the demo's three prompt sets, on a BF16 engine with 8 slots and the prefix
cache on (the demo's setting), with and without --batch-invariant: a serial
capture (concurrency 1), then a burst at concurrency 8 (the burst reuses the
prefixes the serial run cached), diffed with `tracekit.analyze.diff`. Prints per set and
mode: identical N/N, bitwise N/N, burst tokens/s; and the throughput ratio
(batch-invariant / batched) at concurrency 8.

    python bench/batch_invariant.py [--threads 1] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.analyze import diff  # noqa: E402
from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402
from tracekit.engine.process import start_engine  # noqa: E402

SETS = {"code16": "tiny.jsonl", "prefix8": "cpu_small.jsonl", "study128": "study_128.jsonl"}


def capture(url: str, prompts: str, out: Path, concurrency: int, max_tokens: int):
    cfg = CaptureConfig(
        url=url,
        prompts=prompts,
        out=str(out),
        concurrency=concurrency,
        max_tokens=max_tokens,
        top_logprobs=5,
        ignore_eos=True,
        progress=False,
    )
    return run_capture(cfg)


def run_mode(extra: list[str], tmp: Path, threads: int, max_tokens: int) -> dict:
    args = ["--dtype", "bf16", "--slots", "8", "--threads", str(threads), *extra]
    out = {}
    with start_engine(args, log_path=str(tmp / "engine.log")) as eng:
        for name, fname in SETS.items():
            prompts = str(ROOT / "fixtures" / "prompts" / fname)
            capture(eng.url, prompts, tmp / f"{name}-serial.h5", 1, max_tokens)
            s = capture(eng.url, prompts, tmp / f"{name}-c8.h5", 8, max_tokens)
            r = diff(tmp / f"{name}-serial.h5", tmp / f"{name}-c8.h5")
            doc = r.to_json()
            n = doc["summary"]["pairs"]
            bitwise = sum(1 for p in doc["pairs"] if p["class"] == "identical" and p.get("bitwise"))
            out[name] = {
                "identical": f"{doc['summary']['identical']}/{n}",
                "bitwise": f"{bitwise}/{n}",
                "burst_tokens_per_s": round(s.tokens / s.wall_s, 1),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    res = {}
    for mode, extra in (("batched", []), ("batch_invariant", ["--batch-invariant"])):
        with tempfile.TemporaryDirectory() as d:
            res[mode] = run_mode(extra, Path(d), a.threads, a.max_tokens)
    tok = {m: sum(v["burst_tokens_per_s"] for v in res[m].values()) for m in res}
    res["throughput_ratio_c8"] = round(tok["batch_invariant"] / tok["batched"], 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
