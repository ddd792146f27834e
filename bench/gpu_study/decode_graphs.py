"""The reference engine's decode step as CUDA graphs (tracekit/engine/stepgraph.py): bitwise, and how fast.

    PYTHONPATH=. python bench/gpu_study/decode_graphs.py --out /tmp/dg --models-dir /tmp/tkm --device cuda
    python bench/gpu_study/decode_graphs.py --smoke --out /tmp/dgsmoke   # CPU, tiny fixture, mode inline

Model: the Qwen3-4B config with RANDOM weights (models.py; not a trained model), BF16, sdpa.
  bitwise     one executor, the same decode chains run eager and through the graphs (rows of
              unequal lengths: padded batches; B = 8, 3, 1; 24 steps): logits bitwise equal?
  step        one batched decode step (engine_checks.decode_speed: wall, kernel time from
              torch.profiler, floor = weights + the batch's KV read once at 4.8 TB/s and at the
              copy bandwidth measured here) at B = 1, 4, 8, 16, context 2,067 (the issue's cell)
              and 128 + 19, eager and graphs
  throughput  Engine.run_until_idle (no HTTP): c requests at once (c = 1, 4, 8, 16; 128-token
              prompts from study_128, 64 tokens each, ignore_eos): generated tokens / wall,
              eager and graphs
  profile     kernel time of one graphed step at B = 8 by kind (GEMM, attention, other)
Writes summary.json and report.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TINY = ROOT / "fixtures" / "models" / "tiny"
P128 = ROOT / "fixtures" / "prompts" / "study_128.jsonl"
P2048 = ROOT / "fixtures" / "prompts" / "study_2048.jsonl"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _rows(path: Path, n: int = 16) -> list[list[int]]:
    return [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()][:n]


def _sync(ex) -> None:
    import torch

    if ex.device.type == "cuda":
        torch.cuda.synchronize(ex.device)


def chain(ex, prompts: list[list[int]], steps: int, slot0: int = 0):
    """Prefill the prompts into slots slot0.., then `steps` greedy batched decode steps: [steps, B, V]."""
    import torch

    firsts = [int(ex.prefill(slot0 + s, p, 0).float().argmax(-1)) for s, p in enumerate(prompts)]
    slots, lengths, nxt = [slot0 + i for i in range(len(prompts))], [len(p) for p in prompts], firsts
    out = []
    for _ in range(steps):
        logits = ex.decode(slots, lengths, nxt)
        out.append(logits.float())
        nxt = logits.float().argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    return torch.stack(out)


def bitwise(ex, graph_mode: str, rows: list[list[int]], steps: int) -> list[dict]:
    """The same chains eager then through the graphs, on one executor."""
    cases = {
        "B8 padded": [r[: 100 + 4 * i] for i, r in enumerate(rows[:8])],
        "B3 padded": [r[: 90 + 7 * i] for i, r in enumerate(rows[8:11])],
    }
    cases["B1"] = [rows[11][:120]]
    out = []
    for name, prompts in cases.items():
        ex.decode_graphs = "eager"
        ex.drop_batch()
        a = chain(ex, prompts, steps)
        ex.decode_graphs = graph_mode
        ex.drop_batch()
        b = chain(ex, prompts, steps)
        d = (a - b).abs()
        out.append(
            {
                "case": name,
                "rows": len(prompts),
                "lengths": [len(p) for p in prompts],
                "steps": steps,
                "bitwise_equal": bool(d.max() == 0),
                "max_abs_diff": float(d.max()),
                "argmax_differs": int((a.argmax(-1) != b.argmax(-1)).sum()),
                "graph_replays": ex._graphs[len(prompts)].steps if ex._graphs.get(len(prompts)) else 0,
            }
        )
        log(f"bitwise {name}: {out[-1]}")
    return out


def fusion_check(ex, ex0, graph_mode: str, rows: list[list[int]], rows2048, steps: int) -> dict:
    """The fused executor (fuse.py: QKV and gate/up as one GEMM each where bitwise) against an
    unfused one: the same chains through the graphs, bitwise? and the graphed step of each."""
    cases = {
        "B8 padded": [r[: 100 + 4 * i] for i, r in enumerate(rows[:8])],
        "B3 padded": [r[: 90 + 7 * i] for i, r in enumerate(rows[8:11])],
        "B1": [rows[11][:120]],
    }
    out = {"report": ex.graph_report()["fused_projections"], "chains": [], "step": []}
    for name, prompts in cases.items():
        for e in (ex, ex0):
            e.decode_graphs = graph_mode
            e.drop_batch()
        a, b = chain(ex, prompts, steps), chain(ex0, prompts, steps)
        d = (a - b).abs()
        out["chains"].append(
            {"case": name, "steps": steps, "bitwise_equal": bool(d.max() == 0), "max_abs_diff": float(d.max())}
        )
        log(f"fused vs unfused {name}: {out['chains'][-1]}")
    for rows_n in (1, 8, 16):
        src = rows2048[:rows_n] if rows_n <= len(rows2048) else (rows2048 * 2)[:rows_n]
        for label, e in (("fused", ex), ("unfused", ex0)):
            r = step_speed(e, graph_mode, src, steps)
            r["fusion"] = label
            out["step"].append(r)
            log(f"step B{rows_n} {label}: {r['step_wall_ms_median']} ms wall, {r['step_device_ms']} ms kernels")
    return out


def step_speed(ex, mode: str, prompts: list[list[int]], steps: int) -> dict:
    from bench.gpu_study.engine_checks import decode_speed

    ex.decode_graphs = mode
    ex.drop_batch()
    r = decode_speed(ex, prompts, steps)
    r["mode"] = mode
    r.pop("step_wall_ms_all", None)
    return r


def throughput(ex, mode: str, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    from tracekit.engine.engine import Engine, GenRequest, TokenEvent

    ex.decode_graphs = mode
    ex.drop_batch()
    eng = Engine(ex, None)
    done = []

    def emit(ev):
        if isinstance(ev, TokenEvent):
            done.append(ev.token_id)

    reqs = [
        GenRequest(prompt_ids=prompts[i % len(prompts)], max_tokens=max_tokens, ignore_eos=True, emit=emit)
        for i in range(c)
    ]
    _sync(ex)
    t0 = time.perf_counter()
    for r in reqs:
        eng.submit(r)
    eng.run_until_idle()
    _sync(ex)
    wall = time.perf_counter() - t0
    steps = eng.counters.decode_steps
    return {
        "mode": mode,
        "concurrency": c,
        "tokens": len(done),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(len(done) / wall, 1),
        "decode_steps": steps,
        "mean_decode_batch": round(eng.counters.decode_rows / max(steps, 1), 2),
    }


def profile_step(ex, prompts: list[list[int]], steps: int = 8) -> dict | None:
    """Kernel time per graphed step by kind (torch.profiler, CUDA kernels)."""
    if ex.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    ex.decode_graphs = "graphs"
    ex.drop_batch()
    for s, p in enumerate(prompts):
        ex.prefill(s, p, 0)
    slots, lengths, nxt = list(range(len(prompts))), [len(p) for p in prompts], [1] * len(prompts)
    for k in range(3):
        ex.decode(slots, [n + k for n in lengths], nxt)
    lengths = [n + 3 for n in lengths]
    _sync(ex)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            ex.decode(slots, [n + k for n in lengths], nxt)
        _sync(ex)
    kinds: dict[str, float] = {}
    n_kernels = 0
    top = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.device_time_total <= 0:
            continue
        name = e.key
        low = name.lower()
        kind = (
            "gemm"
            if any(t in low for t in ("gemm", "nvjet", "cublas", "cutlass", "sm90_xmma"))
            else "attention"
            if any(t in low for t in ("flash", "fmha", "attention", "sdpa", "efficient"))
            else "copy/cat"
            if any(t in low for t in ("copy", "cat", "index", "scatter", "gather"))
            else "other elementwise/reduction"
        )
        kinds[kind] = kinds.get(kind, 0.0) + e.device_time_total / 1e3 / steps
        n_kernels += e.count
        top.append((round(e.device_time_total / 1e3 / steps, 3), e.count // steps, name[:80]))
    top.sort(reverse=True)
    return {
        "rows": len(prompts),
        "context": lengths[0],
        "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items())},
        "kernel_ms_total": round(sum(kinds.values()), 3),
        "kernels_per_step": n_kernels // steps,
        "top": top[:12],
    }


def report(doc: dict) -> str:
    L = [
        f"# Decode step as CUDA graphs: {doc['model']} ({doc['weights']})",
        "",
        f"Device: {doc['device_name']}; torch {doc['torch']}, transformers {doc['transformers']}. "
        f"Engine executor: BF16, sdpa, slots {doc['slots']}.",
        "",
        "## Bitwise: graphs vs the eager step (same executor, same chains)",
        "",
        "| case | rows | lengths | steps | bitwise | max abs diff | argmax differs | replays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in doc["bitwise"]:
        L.append(
            f"| {b['case']} | {b['rows']} | {min(b['lengths'])}-{max(b['lengths'])} | {b['steps']} | "
            f"{b['bitwise_equal']} | {b['max_abs_diff']:g} | {b['argmax_differs']} | {b['graph_replays']} |"
        )
    L += ["", "## One decode step vs the bandwidth floor", ""]
    L += ["| rows | context | mode | wall ms | kernels ms | floor ms (4.8 TB/s) | wall / floor | kernels / floor |"]
    L += ["|---|---|---|---|---|---|---|---|"]
    for s in doc["step"]:
        L.append(
            f"| {s['rows']} | {s['context_tokens_per_row'][0]} | {s['mode']} | {s['step_wall_ms_median']} | "
            f"{s['step_device_ms']} | {s['floor_ms_4p8tbs']} | {s['wall_over_floor']} | {s['device_over_floor']} |"
        )
    L += ["", f"## Engine throughput (Engine.run_until_idle, 128-token prompts, {doc['max_tokens']} tokens each)", ""]
    L += ["| concurrency | mode | tokens/s | wall s | decode steps | mean batch |", "|---|---|---|---|---|---|"]
    for t in doc["throughput"]:
        L.append(
            f"| {t['concurrency']} | {t['mode']} | {t['tokens_per_s']} | {t['wall_s']} | {t['decode_steps']} | "
            f"{t['mean_decode_batch']} |"
        )
    if doc.get("profile"):
        p = doc["profile"]
        L += ["", f"## Kernel time of one graphed step, {p['rows']} rows x {p['context']} positions", ""]
        L += [f"{p['kernels_per_step']} kernels, {p['kernel_ms_total']} ms: {json.dumps(p['kernel_ms_by_kind'])}", ""]
        L += ["| ms/step | launches/step | kernel |", "|---|---|---|"]
        L += [f"| {t[0]} | {t[1]} | `{t[2]}` |" for t in p["top"]]
    if doc.get("fusion"):
        f = doc["fusion"]
        rep = f["report"]
        L += ["", "## Fused projections (fuse.py) vs unfused", ""]
        L += [
            f"groups fused {rep.get('groups_fused')}, left {rep.get('groups_left')}, max rows {rep.get('max_rows')}",
            "",
        ]
        L += ["| case | steps | bitwise | max abs diff |", "|---|---|---|---|"]
        L += [f"| {c['case']} | {c['steps']} | {c['bitwise_equal']} | {c['max_abs_diff']} |" for c in f["chains"]]
        L += [
            "",
            "| rows | context | projections | wall ms | kernels ms | floor ms | wall / floor |",
            "|---|---|---|---|---|---|---|",
        ]
        L += [
            f"| {r['rows']} | {r['context_tokens_per_row'][0]} | {r['fusion']} | {r['step_wall_ms_median']} "
            f"| {r['step_device_ms']} | {r['floor_ms_4p8tbs']} | {r['wall_over_floor']} |"
            for r in f["step"]
        ]
    L += ["", f"Phase times (s): {json.dumps(doc['seconds'])}", ""]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", default="/tmp/tkm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny fixture model, mode inline, small sizes")
    ap.add_argument(
        "--fusion", action="store_true", help="also: fused vs unfused projections (fuse.py), bitwise and speed"
    )
    a = ap.parse_args(argv)
    import torch
    import transformers

    from tracekit.engine.executor import ModelExecutor

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict = {}
    mode = "inline" if a.smoke else "graphs"
    t = time.perf_counter()
    if a.smoke:
        a.device, model = "cpu", TINY
        rows128 = [(r * 8)[:128] for r in _rows(P128)]
        rows2048 = [r[:200] for r in _rows(P2048)]
    else:
        from bench.gpu_study.calibrated import model_dir

        model = model_dir(Path(a.models_dir), a.model, a.device)
        rows128, rows2048 = _rows(P128), _rows(P2048)
    ctx = 256 if a.smoke else 2048 + 80
    fuse = True if a.fusion else None  # None: the default (on CUDA, off on CPU)
    ex = ModelExecutor(
        model, "bf16", "sdpa", a.device, slots=16, max_context=ctx, decode_graphs=mode, fuse_projections=fuse
    )
    times["load"] = round(time.perf_counter() - t, 1)
    doc = {
        "model": "tiny fixture model" if a.smoke else f"{a.model} shape",
        "weights": "trained tiny weights (smoke)" if a.smoke else "real architecture, RANDOM weights (models.py)",
        "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "slots": 16,
    }
    t = time.perf_counter()
    doc["bitwise"] = bitwise(ex, mode, rows128, 4 if a.smoke else 24)
    times["bitwise"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    doc["step"] = []
    steps = 2 if a.smoke else 16
    cells = ((1, rows2048), (4, rows2048), (8, rows2048), (16, rows2048), (8, rows128), (16, rows128))
    for rows, src in cells[1:3] if a.smoke else cells:
        for m in ("eager", mode):
            doc["step"].append(step_speed(ex, m, src[:rows] if rows <= len(src) else (src * 2)[:rows], steps))
            s = doc["step"][-1]
            log(
                f"step B{rows} ctx {s['context_tokens_per_row'][0]} {m}: {s['step_wall_ms_median']} ms wall, "
                f"{s['step_device_ms']} ms kernels, floor {s['floor_ms_4p8tbs']} ms"
            )
    times["step"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    doc["throughput"], doc["max_tokens"] = [], 4 if a.smoke else 64
    for c in (1, 4) if a.smoke else (1, 4, 8, 16):
        for m in ("eager", mode):
            doc["throughput"].append(throughput(ex, m, rows128, c, doc["max_tokens"]))
            log(f"throughput {doc['throughput'][-1]}")
    times["throughput"] = round(time.perf_counter() - t, 1)
    if a.fusion:
        t = time.perf_counter()
        ex0 = ModelExecutor(
            model, "bf16", "sdpa", a.device, slots=16, max_context=ctx, decode_graphs=mode, fuse_projections=False
        )
        doc["fusion"] = fusion_check(ex, ex0, mode, rows128, rows2048, 4 if a.smoke else 16)
        del ex0
        times["fusion"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    doc["profile"] = profile_step(ex, rows2048[:8])
    times["profile"] = round(time.perf_counter() - t, 1)
    doc["graph_report"] = ex.graph_report()
    doc["seconds"] = times
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = report(doc)
    (out / "report.md").write_text(md)
    print(md)
    ok = all(b["bitwise_equal"] for b in doc["bitwise"])
    ok = ok and all(c["bitwise_equal"] for c in doc.get("fusion", {}).get("chains", []))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
