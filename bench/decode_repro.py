"""Is the teacher-forced `decode` history reproducible on this GPU, per SDPA kernel?

Runs one decode chain (prompt prefill, then 32 single-token steps; random
weights, a bench/diagnostic_bench.py config) several times eagerly and as
CUDA graphs, under transformers' `sdpa` with each SDPA backend allowed in
turn (torch's default choice, flash, math, cuDNN) and under the diagnostic's
`sdpa_lower_right` (which keeps one-token steps off cuDNN), and reports
whether the logits are bitwise equal run to run and graphs to eager, with
the largest differences. Writes one JSON object.

    PYTHONPATH=. python bench/decode_repro.py --config qwen3-0.6b --out-json repro.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.diagnostic_bench import build_model  # noqa: E402
from tracekit.capture.teacher.history import parse_histories  # noqa: E402
from tracekit.capture.teacher.trie import run_histories  # noqa: E402


def chains(lm, batch: int, prompt: int, gen: int, backends) -> dict:
    import torch
    from torch.nn.attention import sdpa_kernel

    ids = torch.randint(2, lm.vocab_size, (batch, prompt + gen), generator=torch.Generator().manual_seed(0))
    x = ids.to(lm.device)[:, :-1]
    dec = [parse_histories("decode")[0].resolve(prompt, gen)]
    eager = dataclasses.replace(lm, cuda_graphs=False)
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        e = [run_histories(eager, x, prompt - 1, dec)["decode"] for _ in range(3)]
        g = [run_histories(lm, x, prompt - 1, dec)["decode"] for _ in range(2)]

    def diff(a, b):
        return (a.float() - b.float()).abs().max().item()

    return {
        "eager_repeat_bitwise": all(torch.equal(e[0], y) for y in e[1:]),
        "graphs_repeat_bitwise": bool(torch.equal(g[0], g[1])),
        "graphs_vs_eager_bitwise": bool(torch.equal(g[0], e[0])),
        "eager_vs_eager_max": max(diff(e[0], y) for y in e[1:]),
        "graphs_vs_eager_max": diff(g[0], e[0]),
    }


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this check needs a CUDA device", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend as B

    res = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(),
        "config": a.config,
        "batch": a.batch,
        "prompt": a.prompt,
        "gen": a.gen,
    }
    for attn, runs in (
        ("sdpa", {"default": None, "flash": [B.FLASH_ATTENTION], "math": [B.MATH], "cudnn": [B.CUDNN_ATTENTION]}),
        ("sdpa_lower_right", {"default": None}),
    ):
        lm = build_model(a.config, "bf16", "cuda", attn)
        for name, backends in runs.items():
            try:
                res[f"{attn}:{name}"] = chains(lm, a.batch, a.prompt, a.gen, backends)
            except RuntimeError as e:  # a backend that cannot run these shapes
                res[f"{attn}:{name}"] = f"{type(e).__name__}: {str(e)[:120]}"
        del lm
        torch.cuda.empty_cache()
    print(json.dumps(res))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
