"""The decode step's GEMMs alone at M = rows: as transformers runs them, and fused (QKV, gate/up).

    PYTHONPATH=. python bench/gpu_study/gemm_floor.py --out /tmp/gf --device cuda [--rows 1,8,16]
    python bench/gpu_study/gemm_floor.py --smoke --out /tmp/gfsmoke   # CPU, tiny shapes

A Qwen3-4B-shaped decode step at 8 rows spends 3.1 of its 7.2 kernel milliseconds in cuBLAS
GEMMs of M = 8 (traces/gpu-h200/decode_graphs/), 2.6 TB/s against the H200's 4.8. This times,
for the Qwen3-4B config's linear shapes (random BF16 weights; every layer its own weights, so
nothing stays in L2), one step's GEMMs as one CUDA graph (no launch gaps), twice:

  separate   q, k, v, o, gate, up, down per layer and the LM head: transformers' calls
  fused      QKV as one [hidden, q + 2 kv] GEMM and gate/up as one, as fused engines run them

and reports milliseconds, the weight bytes read, and TB/s: how much of the 2x-the-floor target
the GEMMs alone take, and what fusing them gives (a fused GEMM rounds as the separate ones do
only if cuBLAS picks the same split of K: checked, not assumed, `bitwise_fused_vs_separate`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {  # qwen3-4b: hidden, q out, kv out, intermediate, vocab, layers
    "qwen3-4b": (2560, 4096, 1024, 9728, 151936, 36),
    "smoke": (64, 64, 32, 128, 512, 2),
}


def build(shape, dev, dtype):
    import torch

    h, q, kv, inter, vocab, layers = shape
    g = torch.Generator(device=dev).manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, device=dev, generator=g) * 0.02).to(dtype)

    sep = [
        dict(q=w(q, h), k=w(kv, h), v=w(kv, h), o=w(h, q), gate=w(inter, h), up=w(inter, h), down=w(h, inter))
        for _ in range(layers)
    ]
    fused = [
        dict(qkv=torch.cat([L["q"], L["k"], L["v"]]), o=L["o"], gu=torch.cat([L["gate"], L["up"]]), down=L["down"])
        for L in sep
    ]
    head = w(vocab, h)
    return sep, fused, head


def step_separate(x, xi, sep, head):
    import torch.nn.functional as F

    outs = []
    for L in sep:
        outs += [F.linear(x, L["q"]), F.linear(x, L["k"]), F.linear(x, L["v"]), F.linear(xi[0], L["o"])]
        outs += [F.linear(x, L["gate"]), F.linear(x, L["up"]), F.linear(xi[1], L["down"])]
    outs.append(F.linear(x, head))
    return outs


def step_fused(x, xi, fused, head):
    import torch.nn.functional as F

    outs = []
    for L in fused:
        outs += [F.linear(x, L["qkv"]), F.linear(xi[0], L["o"]), F.linear(x, L["gu"]), F.linear(xi[1], L["down"])]
    outs.append(F.linear(x, head))
    return outs


def timed(fn, dev, repeats: int) -> float:
    """Median ms of fn() (as one CUDA graph on CUDA)."""
    import torch

    if torch.device(dev).type != "cuda":
        walls = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t)
        return statistics.median(walls) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b))
    return statistics.median(walls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    import torch

    dev = "cpu" if a.smoke else a.device
    shape = SHAPES["smoke" if a.smoke else "qwen3-4b"]
    h, q, kv, inter, vocab, layers = shape
    sep, fused, head = build(shape, dev, torch.bfloat16)
    wbytes = 2 * (layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + vocab * h)
    doc = {
        "shape": "smoke" if a.smoke else "qwen3-4b config (random BF16 weights)",
        "device": torch.cuda.get_device_name() if torch.device(dev).type == "cuda" else "cpu",
        "torch": torch.__version__,
        "weight_bytes": wbytes,
        "cells": [],
    }
    for m in [int(r) for r in a.rows.split(",")]:
        g = torch.Generator(device=dev).manual_seed(m)
        x = torch.randn(m, h, device=dev, generator=g).to(torch.bfloat16)
        xi = (
            torch.randn(m, q, device=dev, generator=g).to(torch.bfloat16),
            torch.randn(m, inter, device=dev, generator=g).to(torch.bfloat16),
        )
        ms_sep = timed(lambda: step_separate(x, xi, sep, head), dev, a.repeats)
        ms_fused = timed(lambda: step_fused(x, xi, fused, head), dev, a.repeats)
        a_out, b_out = step_separate(x, xi, sep[:1], head), step_fused(x, xi, fused[:1], head)
        qkv_sep = torch.cat(a_out[:3], dim=-1)
        gu_sep = torch.cat(a_out[4:6], dim=-1)
        bitwise = bool(torch.equal(qkv_sep, b_out[0]) and torch.equal(gu_sep, b_out[2]))
        cell = {
            "rows": m,
            "separate_ms": round(ms_sep, 3),
            "fused_ms": round(ms_fused, 3),
            "separate_tb_s": round(wbytes / ms_sep / 1e9, 2),
            "fused_tb_s": round(wbytes / ms_fused / 1e9, 2),
            "weights_at_4p8_ms": round(wbytes / 4.8e12 * 1e3, 3),
            "bitwise_fused_vs_separate": bitwise,
        }
        doc["cells"].append(cell)
        print(json.dumps(cell), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_floor.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
