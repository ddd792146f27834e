"""Tensor-parallel size as a divergence axis: TP=1 vs TP=2 in the teacher-forced diagnostic.

    PYTHONPATH=. python bench/gpu_study/tp.py --out OUT --models-dir /tmp/tkm \
        [--model qwen3-4b] [--prompts 4] [--device cuda] [--backend nccl|gloo] [--smoke]

One model (models.py: a real architecture's config, RANDOM weights from a fixed seed, peaked LM
head) and the first --prompts prompts of fixtures/prompts/study_2048.jsonl (2,048-token inputs),
32 greedy tokens. Two captures of the same histories (full, prefix:1024, chunked:512, decode) and
dtypes (bf16, fp32): `--tp 1`, then `--tp 2 --from tp1.h5` (both sides replay the same tokens).
Then `tracekit diff tp1.h5 tp2.h5` per (history, dtype) and the max |Δ logit| over the ids both
top-k rows hold. Writes OUT/tp1.h5, tp2.h5, results.json, evidence.md, progress.log.

--backend gloo with one GPU runs both ranks on cuda:0 (gloo's all-reduce on CUDA tensors goes
through host memory; the split matmuls are the GPU's own). nccl needs one GPU per rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HISTORIES = ("full", "prefix:1024", "chunked:512", "decode")
SMOKE_HISTORIES = ("full", "prefix:16", "chunked:8", "decode")
DTYPES = ("bf16", "fp32")
_LOG: Path | None = None


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if _LOG:
        with _LOG.open("a") as f:
            f.write(line + "\n")


def tracekit(*args, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tracekit", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if _LOG:  # every command's stderr, whole, beside the progress log
        with (_LOG.parent / "commands.log").open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{p.stderr}\n[exit {p.returncode}]\n")
    if check and p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def rows(path: Path) -> dict:
    """(key, history, dtype) -> (tokens, top-k ids, top-k logits)."""
    from tracekit.store import TraceReader

    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            c = r.tokens(i)
            out[(t.key[i], t.history[i], t.dtype[i])] = (c.token_id, c.topk_id, c.topk_logit)
    return out


def logit_delta(a, b) -> tuple[float, int]:
    """max |logit_A(id) - logit_B(id)| over the ids in both top-k rows, and the positions whose
    top-1 differs."""
    (_, ids_a, lg_a), (_, ids_b, lg_b) = a, b
    worst, top1 = 0.0, int((ids_a[:, 0] != ids_b[:, 0]).sum())
    for ia, la, ib, lb in zip(ids_a, lg_a, ids_b, lg_b):
        _, xa, xb = np.intersect1d(ia, ib, return_indices=True)
        if len(xa):
            worst = max(worst, float(np.abs(la[xa].astype(np.float64) - lb[xb]).max()))
    return worst, top1


def main(argv=None) -> int:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="--tp-backend for the TP=2 run (default: the command's)")
    ap.add_argument("--smoke", action="store_true", help="the architecture shrunk, short prompts (a CPU check)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _LOG = out / "progress.log"
    hist = SMOKE_HISTORIES if a.smoke else HISTORIES

    from bench.gpu_study import models

    mdir = Path(a.models_dir) / a.model
    t0 = time.perf_counter()
    if not (mdir / "config.json").exists():
        log(f"building {a.model} (random weights, seed {models.SEED}, peaked head) on {a.device}")
        model = models.build(a.model, a.device, a.smoke, peaked=True)
        models.save(model, a.model, Path(a.models_dir), a.smoke)
        del model
    build_s = time.perf_counter() - t0
    src = ROOT / "fixtures" / "prompts" / ("study_128.jsonl" if a.smoke else "study_2048.jsonl")
    lines = [x for x in src.read_text().splitlines() if x.strip()][: a.prompts]
    if a.smoke:  # ids of the smoke config's vocabulary, 40 tokens
        lines = [
            json.dumps({**json.loads(x), "prompt": [i % 4000 for i in json.loads(x)["prompt"][:40]]}) for x in lines
        ]
    pf = out / "prompts.jsonl"
    pf.write_text("\n".join(lines) + "\n")
    prompt_lens = [len(json.loads(x)["prompt"]) for x in lines]

    common = ["--history", ",".join(hist), "--dtype", ",".join(DTYPES), "--device", a.device]
    timing = {"build_s": round(build_s, 1)}
    t0 = time.perf_counter()
    log(f"TP=1: {len(lines)} prompts of {prompt_lens} tokens, {a.max_tokens} tokens, {hist} x {DTYPES}")
    tracekit(
        "capture", "--teacher-forced", mdir, "--prompts", pf, "--max-tokens", a.max_tokens, *common,
        "--out", out / "tp1.h5",
    )  # fmt: skip
    timing["tp1_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    extra = ["--tp-backend", a.backend] if a.backend else []
    log(f"TP=2 ({a.backend or 'default backend'}), replaying TP=1's tokens")
    tracekit("capture", "--teacher-forced", mdir, "--from", out / "tp1.h5", *common, "--tp", 2, *extra,
             "--out", out / "tp2.h5")  # fmt: skip
    timing["tp2_s"] = round(time.perf_counter() - t0, 1)
    log(f"captures done: {timing}")

    ra, rb = rows(out / "tp1.h5"), rows(out / "tp2.h5")
    cells, md = [], []
    for d in DTYPES:
        for h in hist:
            sel = f"history={h},dtype={d}"
            p = tracekit("diff", out / "tp1.h5", out / "tp2.h5", "--a-select", sel, "--b-select", sel, "--json")
            doc = json.loads(p.stdout)
            classes: dict[str, int] = {}
            for pair in doc["pairs"]:
                classes[pair["class"]] = classes.get(pair["class"], 0) + 1
            keys = [k for k in ra if k[1] == h and k[2] == d]
            deltas = [logit_delta(ra[k], rb[k]) for k in keys if k in rb]
            cell = {
                "dtype": d,
                "history": h,
                "pairs": len(doc["pairs"]),
                "classes": classes,
                "exit": p.returncode,
                "max_abs_dlogit": max((x[0] for x in deltas), default=None),
                "top1_differs_at": sum(x[1] for x in deltas),
                "positions": int(sum(len(ra[k][0]) for k in keys)),
                "bitwise_equal_rows": sum(
                    bool(np.array_equal(ra[k][2], rb[k][2], equal_nan=True)) for k in keys if k in rb
                ),
            }
            cells.append(cell)
            m = tracekit("diff", out / "tp1.h5", out / "tp2.h5", "--a-select", sel, "--b-select", sel, "--markdown")
            md.append(f"### {d}, history `{h}`\n\n{m.stdout.strip()}\n")
            dl, t1 = cell["max_abs_dlogit"], cell["top1_differs_at"]
            log(f"{d} {h}: {classes} max|dlogit| {dl:.3g} top-1 differs at {t1}")
    with_run = {}
    from tracekit.store import TraceReader

    for n in (1, 2):
        with TraceReader(out / f"tp{n}.h5") as r:
            with_run[f"tp{n}"] = {
                k: r.meta.run.get(k) for k in ("tp", "tp_backend", "tp_devices", "device", "cuda_graphs")
            }
    doc = {
        "model": a.model,
        "weights": "random (fixed seed, peaked LM head); not a trained checkpoint",
        "prompts": len(lines),
        "prompt_lens": prompt_lens,
        "max_tokens": a.max_tokens,
        "backend": a.backend,
        "runs": with_run,
        "timing": timing,
        "cells": cells,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    head = [
        f"# TP=1 vs TP=2, teacher-forced, {a.model} shape (random weights, fixed seed)\n",
        f"{len(lines)} prompts of {prompt_lens} tokens, {a.max_tokens} greedy tokens (TP=1's, replayed by TP=2); "
        f"TP=2 backend {a.backend or 'default'}; runs {json.dumps(with_run)}.\n",
        "| dtype | history | pairs | classes | max abs dlogit (shared top-k ids) | top-1 differs at "
        "| bitwise equal rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        cls = ", ".join(f"{k} {v}" for k, v in sorted(c["classes"].items()))
        head.append(
            f"| {c['dtype']} | `{c['history']}` | {c['pairs']} | {cls} | {c['max_abs_dlogit']:.3g} | "
            f"{c['top1_differs_at']}/{c['positions']} | {c['bitwise_equal_rows']}/{c['pairs']} |"
        )
    (out / "evidence.md").write_text("\n".join(head) + "\n\n" + "\n".join(md))
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
