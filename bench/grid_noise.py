"""Measure the numeric noise that `tracekit diff`'s tolerances must admit.

Captures the same prompts (fixtures/prompts: tiny, study_128, cpu_small; 64
tokens, EOS ignored, top-20 with raw logits) from the reference engine
(`tracekit serve`, tiny model, CPU) in the configurations whose differences are
benign, and measures, at every position where both streams still hold the same
tokens:

  batch vs solo   --no-prefix-cache: serial (c=1) vs concurrent (c=8, padded batched decode)
  prefix split    serial without prefix cache vs serial with token-granular reuse
                  (--block-size 1, second pass: every prompt prefilled in two parts)

for BF16, FP16 and FP32:

  drift           |Δ chosen logprob| (nats): per position, per request max and mean
  logit movement  |Δ logit| of each of A's top-5 ids between the traces, in steps of
                  the run's grid at the row's scale (analyze/grid.py) and in nats
  top logits      magnitude of the top-1 logit (sets the grid spacing)
  flips           at each first difference: both gaps (steps, nats), both candidates'
                  movement, each side's distance below its own top-1

docs/analysis.md "Thresholds" quotes these numbers.

    python bench/grid_noise.py [--json] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracekit.analyze.grid import steps  # noqa: E402
from tracekit.dtypes import DTYPES  # noqa: E402
from tracekit.engine.process import start_engine  # noqa: E402
from tracekit.store import TraceReader  # noqa: E402

PROMPT_SETS = ("tiny.jsonl", "study_128.jsonl", "cpu_small.jsonl")


def capture(url: str, prompts: Path, out: Path, concurrency: int, max_tokens: int) -> Path:
    cmd = [sys.executable, "-m", "tracekit", "capture", "--http", url, "--prompts", str(prompts)]
    cmd += ["--out", str(out), "--concurrency", str(concurrency), "--max-tokens", str(max_tokens), "--ignore-eos"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode:
        raise SystemExit(f"capture failed: {p.stderr[-2000:]}")
    return out


def traces(tmp: Path, dtype: str, max_tokens: int) -> dict[str, Path]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join((ROOT / "fixtures" / "prompts" / n).read_text() for n in PROMPT_SETS))
    out = {}
    base = ["--threads", "1", "--slots", "8", "--dtype", dtype]
    with start_engine(base + ["--no-prefix-cache"]) as eng:
        out["solo"] = capture(eng.url, prompts, tmp / f"{dtype}_solo.h5", 1, max_tokens)
        out["batch"] = capture(eng.url, prompts, tmp / f"{dtype}_batch.h5", 8, max_tokens)
    with start_engine(base + ["--block-size", "1"]) as eng:
        capture(eng.url, prompts, tmp / f"{dtype}_warm1.h5", 1, max_tokens)
        out["split"] = capture(eng.url, prompts, tmp / f"{dtype}_split.h5", 1, max_tokens)
    return out


def pct(x, qs=(50, 99, 99.9, 100)) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if not len(x):
        return {}
    return {f"p{q:g}": float(np.percentile(x, q)) for q in qs}


def compare(a_path: Path, b_path: Path, bits: int) -> dict:
    drift, move_steps, move_nats, top1, pair_max, pair_mean, pair_n, flips = [], [], [], [], [], [], [], []
    with TraceReader(a_path) as ra, TraceReader(b_path) as rb:
        ib = rb.requests.index_by_key()
        for i, key in enumerate(ra.requests.key.tolist()):
            ta, tb = ra.tokens(i), rb.tokens(ib[key])
            n = min(len(ta), len(tb))
            mism = np.flatnonzero(ta.token_id[:n] != tb.token_id[:n])
            t = int(mism[0]) if len(mism) else n
            d = np.abs(ta.logprob[:t].astype(np.float64) - tb.logprob[:t])
            drift.append(d)
            if t:
                pair_max.append(d.max())
                pair_mean.append(d.mean())
                pair_n.append(t)
            la, lb = ta.topk_logit.astype(np.float64), tb.topk_logit.astype(np.float64)
            top1.append(la[:n, 0])
            for p in range(t):
                scale = max(abs(la[p, 0]), abs(lb[p, 0]))
                for j in range(5):
                    hit = np.flatnonzero(tb.topk_id[p] == ta.topk_id[p, j])
                    if len(hit):
                        x, y = la[p, j], lb[p, hit[0]]
                        move_steps.append(abs(float(steps(x, y, bits, scale))))
                        move_nats.append(abs(x - y))
            if t < n:
                flips.append(flip(ta, tb, t, bits, d))
    return {
        "pairs": len(ra.requests),
        "diverged": len(flips),
        "positions": int(sum(len(d) for d in drift)),
        "drift_per_position_nats": pct(np.concatenate(drift)),
        "drift_max_per_request_nats": pct(pair_max),
        "drift_mean_per_request_nats": pct(pair_mean),
        "mean_tol_needed": _mean_bound_headroom(pair_max, pair_mean, pair_n),
        "logit_move_steps": pct(move_steps),
        "logit_move_nats": pct(move_nats),
        "top1_logit": pct(np.abs(np.concatenate(top1)), (5, 50, 95, 100)),
        "flips": flips,
    }


def _mean_bound_headroom(pmax, pmean, pn, max_tol: float = 0.5) -> float | None:
    """The smallest mean tolerance M for which every request passes the mean
    bound mean <= M + (max_tol - M) / n (docs/analysis.md), at max_tol 0.5 nats."""
    need = [(m - max_tol / n) / (1 - 1 / n) for m, n in zip(pmean, pn) if n > 1]
    return float(max([0.0] + need))


def flip(ta, tb, t: int, bits: int, d: np.ndarray) -> dict:
    xa, xb = int(ta.token_id[t]), int(tb.token_id[t])

    def logit(tok, x):
        hit = np.flatnonzero(tok.topk_id[t] == x)
        return float(tok.topk_logit[t, hit[0]]) if len(hit) else float("nan")

    la_a, la_b, lb_a, lb_b = logit(ta, xa), logit(ta, xb), logit(tb, xa), logit(tb, xb)
    top_a, top_b = float(ta.topk_logit[t].max()), float(tb.topk_logit[t].max())
    sa, sb = max(abs(top_a), abs(la_b)), max(abs(top_b), abs(lb_a))
    s = max(sa, sb)
    return {
        "position": t,
        "logits_a": [la_a, la_b],
        "logits_b": [lb_b, lb_a],
        "gap_a_steps": float(steps(la_a, la_b, bits, sa)),
        "gap_b_steps": float(steps(lb_b, lb_a, bits, sb)),
        "below_top1_steps": [float(steps(top_a, la_a, bits, sa)), float(steps(top_b, lb_b, bits, sb))],
        "move_steps": [float(steps(lb_a, la_a, bits, s)), float(steps(lb_b, la_b, bits, s))],
        "move_nats": [lb_a - la_a, lb_b - la_b],
        "drift_max": float(d.max()) if len(d) else None,
        "drift_mean": float(d.mean()) if len(d) else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="Engine dtypes to measure.")
    args = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            tr = traces(Path(tmp), dtype, args.max_tokens)
            bits = DTYPES[dtype].mantissa_bits
            out[dtype] = {
                "batch_vs_solo": compare(tr["solo"], tr["batch"], bits),
                "prefix_split": compare(tr["solo"], tr["split"], bits),
            }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for dtype, cmp in out.items():
        for name, r in cmp.items():
            print(f"== {dtype} {name}: {r['diverged']}/{r['pairs']} diverged, {r['positions']} positions compared")
            for k in (
                "drift_per_position_nats",
                "drift_max_per_request_nats",
                "drift_mean_per_request_nats",
                "logit_move_steps",
                "logit_move_nats",
                "top1_logit",
            ):
                print(f"  {k}: " + ", ".join(f"{q} {v:.4g}" for q, v in r[k].items()))
            print(f"  mean tolerance needed (max 0.5): {r['mean_tol_needed']}")
            for f in r["flips"]:
                print(f"  flip {json.dumps(f)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
