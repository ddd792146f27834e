"""Where a history's device time goes: torch.profiler kernel times by kind.

For one model shape and batch it runs the plain forward (logits for the
scored positions), `prefix:HALF`, `chunked:HALF`, `decode` and the prefix's
first segment alone, once untimed and then under torch.profiler, and sums
the CUDA kernels' time by kind (attention, GEMM, copies and concatenation,
other elementwise), with the six longest kernels and the host time until
the call returned. Needs CUDA; random weights (bench/diagnostic_bench.py's
configs). Writes one JSON object.

    PYTHONPATH=. python bench/diagnostic_profile.py --config qwen3-4b --cells 4x8192,1x8192 --out-json prof.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.diagnostic_bench import build_model  # noqa: E402
from tracekit.capture.teacher.history import parse_histories  # noqa: E402
from tracekit.capture.teacher.trie import run_histories  # noqa: E402

KINDS = (
    ("attn", ("sdpa", "flash", "fmha", "attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "xmma")),
    ("copy_cat", ("cat", "copy", "memcpy")),
)


def kind(name: str) -> str:
    n = name.lower()
    return next((k for k, pats in KINDS if any(p in n for p in pats)), "other")


def profile_cell(lm, batch: int, seq_len: int, gen: int = 32) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    p = seq_len - gen
    half = p // 2
    ids = torch.randint(2, lm.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(lm.device)
    x = ids[:, :-1]

    def hist(text):
        return lambda: run_histories(lm, x, p - 1, [parse_histories(text)[0].resolve(p, gen)])

    variants = {
        "plain": lambda: lm.model(input_ids=x, logits_to_keep=gen),
        "prefix": hist(f"prefix:{half}"),
        "seg1_only": lambda: lm.model(input_ids=x[:, :half], logits_to_keep=1),
        "chunked": hist(f"chunked:{half}"),
        "decode": hist("decode"),
    }
    cell = {}
    with torch.inference_mode():
        for k, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            by, top = {}, {}
            for e in prof.key_averages():
                if "CUDA" not in str(getattr(e, "device_type", "")):
                    continue
                dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                by[kind(e.key)] = by.get(kind(e.key), 0) + dt
                top[e.key[:60]] = dt
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0  # until the call returned (it may wait on a full launch queue)
            torch.cuda.synchronize()
            cell[k] = {
                "host_ms": round(host * 1e3, 1),
                "wall_ms": round(wall * 1e3, 1),
                "device_ms": {c: round(v / 1e3, 1) for c, v in by.items()},
                "top": sorted(((round(v / 1e3, 1), n) for n, v in top.items()), reverse=True)[:6],
            }
    return cell


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="qwen3-4b")
    ap.add_argument("--cells", default="4x8192,1x8192", help="comma list of BATCHxSEQ_LEN")
    ap.add_argument("--attn", default="auto")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this profile needs a CUDA device", file=sys.stderr)
        return 2
    lm = build_model(a.config, "bf16", "cuda", a.attn)
    res = {}
    for c in a.cells.split(","):
        b, s = (int(v) for v in c.split("x"))
        res[f"{a.config}@{s}xB{b}"] = profile_cell(lm, b, s)
    print(json.dumps(res))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
