"""What fused kernels would buy the decode step: HF's static cache, eager and torch.compile'd, vs the floor.

    PYTHONPATH=. python bench/gpu_study/decode_fused.py --out /tmp/df --device cuda [--rows 8,1]
    python bench/gpu_study/decode_fused.py --smoke --out /tmp/dfsmoke   # CPU, tiny shapes, no compile

The engine's decode step as CUDA graphs with holes (tracekit/engine/stepgraph.py) is bitwise its
eager step and 4.5-4.7x the bandwidth floor at 8 rows (traces/gpu-h200/decode_graphs/): its
kernels alone are 3.3x the floor (2,194 launches, 2.4 ms of unfused elementwise work). This study
measures, on the same shape (Qwen3-4B config, RANDOM weights, models.py; BF16; rows of 2,048
prompt tokens then single-token steps), how far a fused step gets and what it does to the numbers:

  eager-dynamic   transformers' eager forward with its DynamicCache (the engine's numerics)
  eager-static    the same with a StaticCache (attention over the whole static buffer, masked)
  compiled        torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) on the
                  static cache: inductor fuses the elementwise work, the step is one CUDA graph
                  (attention inside it)

Per variant: wall per step (median of --steps after warm-up), kernel time per step
(torch.profiler), compile seconds, and the logits of the same steps against eager-dynamic's
(max |diff|, argmax agreement). Floor: every weight byte + the rows' KV read once at 4.8 TB/s
(the static variants read the whole buffer: its length is printed). The engine's own graphed
step is measured elsewhere (decode_graphs.py); `--engine` adds its host-side split here: the
time the host spends before the first replay (the deferred masks), in the graph/hole loop and
after it, against the step's wall.
Writes summary.json and report.md under --out.
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
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _sync(dev) -> None:
    import torch

    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def weights_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes


class Variant:
    """One way to run the decode steps of one batch: prefill(ids) then step(token, position)."""

    def __init__(self, model, name: str, rows: int, cap: int):
        from transformers import DynamicCache, StaticCache

        self.model, self.name, self.rows, self.cap = model, name, rows, cap
        self.static = name != "eager-dynamic"
        self.cache = StaticCache(config=model.config, max_cache_len=cap) if self.static else DynamicCache()
        self.forward = model.forward
        self.compile_s = 0.0
        if name == "compiled":
            import torch

            self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def prefill(self, ids) -> None:
        import torch

        n = ids.shape[1]
        kw = {"cache_position": torch.arange(n, device=ids.device)} if self.static else {}
        with torch.inference_mode():
            self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1, **kw)

    def step(self, tok, pos: int):
        import torch

        dev = tok.device
        kw = {"cache_position": torch.tensor([pos], device=dev)} if self.static else {}
        posids = torch.full((tok.shape[0], 1), pos, device=dev)
        if self.name == "compiled":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            out = self.forward(
                input_ids=tok, position_ids=posids, past_key_values=self.cache, use_cache=True, logits_to_keep=1, **kw
            )
        return out.logits[:, -1, :].clone()


def run_variant(model, name: str, prompt, steps: int, warm: int, cap: int, dev) -> dict:
    """Prefill, `warm` steps (compile and capture), then `steps` timed steps; logits of the first
    warm + steps steps (teacher-forced on the same tokens for every variant)."""
    import torch

    rows, n = prompt.shape
    v = Variant(model, name, rows, cap)
    v.prefill(prompt)
    g = torch.Generator(device="cpu").manual_seed(1)
    toks = torch.randint(0, model.config.vocab_size, (warm + steps, rows, 1), generator=g).to(dev)
    logits, walls = [], []
    t0 = time.perf_counter()
    for k in range(warm):
        logits.append(v.step(toks[k], n + k).float().cpu())
        if k == 0:
            _sync(dev)
            v.compile_s = time.perf_counter() - t0
    for k in range(warm, warm + steps):
        _sync(dev)
        t = time.perf_counter()
        out = v.step(toks[k], n + k)
        _sync(dev)
        walls.append(time.perf_counter() - t)
        logits.append(out.float().cpu())
    kernel_ms = None
    if torch.device(dev).type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in range(4):
                v.step(toks[warm + steps - 1], n + warm + steps + k)
            _sync(dev)
        kernel_ms = sum(e.device_time_total for e in prof.key_averages()) / 1e3 / 4
    first_s = v.compile_s
    del v
    torch.cuda.empty_cache() if torch.device(dev).type == "cuda" else None
    return {
        "variant": name,
        "rows": rows,
        "prompt": n,
        "cache_len": cap if name != "eager-dynamic" else None,
        "step_wall_ms": round(statistics.median(walls) * 1e3, 3),
        "step_wall_ms_all": [round(w * 1e3, 2) for w in walls],
        "kernel_ms": None if kernel_ms is None else round(kernel_ms, 3),
        "first_step_s": round(first_s, 1),
        "logits": torch.stack(logits),  # [warm + steps, rows, V], dropped before writing
    }


def compare(ref, other) -> dict:
    d = (ref - other).abs()
    return {
        "max_abs_logit_diff": round(float(d.max()), 4),
        "mean_abs_logit_diff": round(float(d.mean()), 5),
        "bitwise": bool(d.max() == 0),
        "argmax_agree": round(float((ref.argmax(-1) == other.argmax(-1)).float().mean()), 4),
    }


def engine_host_split(model_dir: str, dev: str, rows: int, prompt_len: int, steps: int = 16) -> dict:
    """The engine's graphed step: host seconds before the first replay (masks), in the
    graph/hole loop and in the rest of decode(), against the synchronised wall."""
    import torch

    from tracekit.engine import stepgraph
    from tracekit.engine.executor import ModelExecutor

    mode = "graphs" if torch.device(dev).type == "cuda" else "inline"
    ex = ModelExecutor(model_dir, "bf16", "sdpa", dev, slots=rows, max_context=prompt_len + 96, decode_graphs=mode)
    g = torch.Generator().manual_seed(2)
    for s in range(rows):
        ex.prefill(s, torch.randint(0, 1000, (prompt_len,), generator=g).tolist(), 0)
    spans: dict[str, list[float]] = {"masks": [], "loop": []}
    real_resolve, real_run = stepgraph.StepGraph._resolve_masks, stepgraph.StepGraph.run

    def resolve(self, cache, mask2d):
        t = time.perf_counter()
        real_resolve(self, cache, mask2d)
        spans["masks"].append(time.perf_counter() - t)

    def run(self, cache, mask2d, ids, pos):
        t = time.perf_counter()
        out = real_run(self, cache, mask2d, ids, pos)
        spans["loop"].append(time.perf_counter() - t)
        return out

    stepgraph.StepGraph._resolve_masks, stepgraph.StepGraph.run = resolve, run
    try:
        slots, n = list(range(rows)), prompt_len
        walls, hosts = [], []
        for k in range(steps + 3):
            _sync(dev)
            t = time.perf_counter()
            ex.decode(slots, [n + k] * rows, [1] * rows)
            hosts.append(time.perf_counter() - t)
            _sync(dev)
            walls.append(time.perf_counter() - t)
    finally:
        stepgraph.StepGraph._resolve_masks, stepgraph.StepGraph.run = real_resolve, real_run
    # where the host's time goes, by function (cProfile over `steps` more steps)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    n += steps + 3
    prof.enable()
    for k in range(steps):
        ex.decode(slots, [n + k] * rows, [1] * rows)
    _sync(dev)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    top = [ln for ln in buf.getvalue().splitlines() if ln.strip()][:45]

    def med(xs):
        return round(statistics.median(xs[-steps:]) * 1e3, 3) if xs else None

    masks = med(spans["masks"])
    return {
        "mode": mode,
        "rows": rows,
        "prompt": prompt_len,
        "wall_ms": med(walls),
        "host_ms_decode_call": med(hosts),
        "host_ms_masks": masks,
        "host_ms_run_incl_masks": med(spans["loop"]),
        "note": "host_ms_* without a sync: where the host's time goes while the GPU runs queued work",
        "profile_steps": steps,
        "profile_top_tottime": top,
    }


def report(doc: dict) -> str:
    lines = [
        f"# Decode step, fused vs the engine's: {doc['model']} ({doc['weights']})",
        "",
        f"Device: {doc['device_name']}; torch {doc['torch']}, transformers {doc['transformers']}. "
        f"Weights {doc['weights_bytes'] / 1e9:.2f} GB, KV {doc['kv_bytes_per_token']} bytes a position.",
        "",
        "| rows | variant | cache len | wall ms | kernels ms | floor ms | wall / floor | kernels / floor "
        "| first step s | vs eager-dynamic: max abs / argmax agree / bitwise |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["cells"]:
        c = r.get("vs_eager_dynamic") or {}
        cache_len = r["cache_len"] or r["prompt"] + r["steps_total"]
        lines.append(
            f"| {r['rows']} | {r['variant']} | {cache_len} | {r['step_wall_ms']} "
            f"| {r['kernel_ms']} | {r['floor_ms']} | {r['wall_over_floor']} | {r['kernels_over_floor']} "
            f"| {r['first_step_s']} | {c.get('max_abs_logit_diff', '-')} / {c.get('argmax_agree', '-')} / "
            f"{c.get('bitwise', '-')} |"
        )
    if doc.get("engine_host"):
        host = dict(doc["engine_host"])
        top = host.pop("profile_top_tottime", [])
        lines += ["", "## The engine's graphed step, host side", "", "```", json.dumps(host), "```"]
        lines += ["", "cProfile of the host, by own time:", "", "```"] + top + ["```"]
    if doc.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in doc["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--rows", default="8")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--variants", default="eager-dynamic,eager-static,compiled")
    ap.add_argument("--engine-model-dir", default=None, help="a saved model dir: adds the engine's host split")
    ap.add_argument("--smoke", action="store_true", help="CPU, the smoke shape of --model, no compile")
    a = ap.parse_args(argv)
    import torch
    import transformers

    from bench.gpu_study.models import build

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in a.variants.split(",") if v]
    if a.smoke:
        a.device, a.prompt, a.steps = "cpu", 48, 4
        variants = [v for v in variants if v != "compiled"]
    model = build(a.model, a.device, smoke=a.smoke)
    wb, kvt = weights_bytes(model), kv_bytes_per_token(model.config)
    doc = {
        "model": f"{a.model} shape" + (" (smoke)" if a.smoke else ""),
        "weights": "real architecture config, RANDOM weights (models.py)",
        "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights_bytes": wb,
        "kv_bytes_per_token": kvt,
        "cells": [],
        "errors": [],
    }
    total = a.warm + a.steps + 4
    cap = a.prompt + total + 1
    for rows in [int(r) for r in a.rows.split(",")]:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (rows, a.prompt), generator=g).to(a.device)
        ref = None
        for name in variants:
            log(f"B{rows} {name} ...")
            try:
                r = run_variant(model, name, prompt, a.steps, a.warm, cap, a.device)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, the others go on
                doc["errors"].append(f"B{rows} {name}: {type(e).__name__}: {str(e)[:300]}")
                log(doc["errors"][-1])
                continue
            lg = r.pop("logits")
            if name == "eager-dynamic":
                ref = lg
            elif ref is not None:
                r["vs_eager_dynamic"] = compare(ref, lg)
            kv_len = cap if name != "eager-dynamic" else a.prompt + a.warm + a.steps // 2
            floor = (wb + rows * kv_len * kvt) / 4.8e12 * 1e3
            r.update(
                steps_total=total,
                floor_ms=round(floor, 3),
                wall_over_floor=round(r["step_wall_ms"] / floor, 2),
                kernels_over_floor=None if r["kernel_ms"] is None else round(r["kernel_ms"] / floor, 2),
            )
            doc["cells"].append(r)
            log(f"B{rows} {name}: {r['step_wall_ms']} ms wall, {r['kernel_ms']} ms kernels, floor {r['floor_ms']} ms")
    if a.engine_model_dir:
        try:
            src = str(ROOT / "fixtures" / "models" / "tiny") if a.engine_model_dir == "tiny" else a.engine_model_dir
            doc["engine_host"] = engine_host_split(src, a.device, 8, a.prompt)
        except Exception as e:  # noqa: BLE001
            doc["errors"].append(f"engine host split: {type(e).__name__}: {str(e)[:300]}")
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = report(doc)
    (out / "report.md").write_text(md)
    print(md)
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
