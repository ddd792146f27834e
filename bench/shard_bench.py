"""Sharding (issue 26): the projected wall time of the user's full GPU study on 1, 8 and 64 GPUs,
from the per-cell times measured on the H200 (traces/gpu-h200/study*/manifest.json), with the
real shard assignment (sha1 of each cell's calibration unit, its engine configuration: every
target of the study calibrates; tracekit/rundir/shards.py, workflows/shards.py); and,
with --cpu, the CPU matrix timed unsharded and as N shards in parallel on this machine.

    python bench/shard_bench.py                 # the projection (reads the manifests; seconds)
    python bench/shard_bench.py --cpu --shards 2 --out /tmp/shard_bench   # ~10 min on 2 cores

Per-cell time, two bounds from each study run (3 or 2 targets ran in parallel on one GPU, each
target's engine configurations one after another): the GPU's throughput (wall / cells: what a
GPU does when kept busy by several engines) and one engine's pace on the shared GPU ((a target's
wall - its engine starts) / its cells). A shard runs its cells one engine at a time, so one
shard per GPU lies between the two. Each shard also starts every engine configuration it
touches (the measured mean start time each).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.rundir.shards import shard_of  # noqa: E402

# The user's study (issue 26): 4 models x 3 input lengths x 2 output lengths x BF16/FP32 x cache
# on/off x 2 concurrencies x 2 routes x B1/B4. Routes and lanes are per-target settings (a target
# per model x route x lanes); the concurrencies of one group share its serial baseline.
MODELS = ("qwen3-4b", "qwen3-06b", "gemma3-1b", "llama31-8b")
INPUTS = ("in128", "in2048", "in8192")
OUTPUTS = (32, 512)
ROUTES = ("native", "v1")
LANES = ("b1", "b4")


def _t(s: str) -> float:
    return dt.datetime.fromisoformat(s).timestamp()


def measured(study: Path) -> dict:
    """Per-cell seconds (both bounds) and the mean engine start of one study run directory."""
    man = json.loads((study / "manifest.json").read_text())
    wall = _t(man["finished_utc"]) - _t(man["started_utc"])
    cells = man["cells"]
    targets = sorted({c.split(".")[0] for c in cells})
    starts = [e["startup_s"] for e in man["engines"].values() if e.get("startup_s")]
    start = sum(starts) / len(starts)
    per_target = [
        (wall - sum(e["startup_s"] for k, e in man["engines"].items() if k.split(".")[0] == t))
        / sum(c.split(".")[0] == t for c in cells)
        for t in targets
    ]
    return {
        "dir": str(study.relative_to(ROOT)),
        "wall_s": round(wall, 1),
        "cells": len(cells),
        "parallel_targets": len(targets),
        "gpu_s_per_cell": round(wall / len(cells), 1),  # throughput bound
        "engine_s_per_cell": round(max(per_target), 1),  # one engine's pace on the shared GPU
        "engine_start_s": round(start, 1),
        "inputs": sorted({c.split(".")[3] for c in cells}),
    }


def full_study() -> list[tuple[str, str, str, int]]:
    """(group id, engine id, input, concurrency) of every cell of the user's full study."""
    out = []
    for m, r, ln, dtype, cache, inp, o, c in itertools.product(
        MODELS, ROUTES, LANES, ("bf16", "fp32"), ("on", "off"), INPUTS, OUTPUTS, (4, 8)
    ):
        eng = f"{m}-{r}-{ln}.{dtype}.cache-{cache}"
        out.append((f"{eng}.{inp}.out{o}", eng, inp, c))
    return out


def project(cells, per_cell: dict, start_s: float, gpus: int) -> dict:
    """Wall seconds on `gpus` GPUs, one shard per GPU: the slowest shard (its cells + its engine starts)."""
    loads = [0.0] * gpus
    engines: list[set] = [set() for _ in range(gpus)]
    for _, eng, inp, _ in cells:
        i = shard_of(eng, gpus)  # the unit: the engine configuration (its calibration, its groups)
        loads[i] += per_cell[inp]
        engines[i].add(eng)
    walls = [load + len(e) * start_s for load, e in zip(loads, engines)]
    ideal = (sum(loads) + len({e for _, e, _, _ in cells}) * start_s) / gpus
    return {"wall_s": max(walls), "ideal_s": ideal, "empty_shards": sum(w == 0 for w in walls)}


def projection() -> dict:
    a, b = measured(ROOT / "traces/gpu-h200/study"), measured(ROOT / "traces/gpu-h200/study2")
    start = round((a["engine_start_s"] + b["engine_start_s"]) / 2, 1)
    cells = full_study()
    out = {"measured": [a, b], "engine_start_s": start, "cells": len(cells), "groups": len({c[0] for c in cells})}
    out["engines"] = len({c[1] for c in cells})
    rows = []
    for bound in ("gpu_s_per_cell", "engine_s_per_cell"):
        per_cell = {"in128": a[bound], "in2048": a[bound], "in8192": b[bound]}
        for g in (1, 8, 64):
            p = project(cells, per_cell, start, g)
            rows.append({"bound": bound, "gpus": g, **{k: round(v, 1) for k, v in p.items()}})
    out["rows"] = rows
    return out


def _h(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def print_projection(p: dict) -> None:
    for m in p["measured"]:
        print(
            f"measured {m['dir']}: {m['cells']} cells ({', '.join(m['inputs'])}), {m['parallel_targets']} targets in "
            f"parallel on 1 H200, wall {m['wall_s']} s -> {m['gpu_s_per_cell']} GPU-s/cell (throughput), "
            f"{m['engine_s_per_cell']} s/cell (one engine's pace), engine start {m['engine_start_s']} s"
        )
    print(
        f"full study: {p['cells']} cells, {p['groups']} serial-baseline groups, {p['engines']} engine configurations; "
        "the 512-token output and the 8B model costed as the measured 32-token cells of the measured models "
        "(a lower bound)"
    )
    print("| per-cell time | GPUs | projected wall (slowest shard) | even split | empty shards |")
    print("|---|---|---|---|---|")
    for r in p["rows"]:
        what = "GPU throughput" if r["bound"] == "gpu_s_per_cell" else "one engine's pace"
        print(f"| {what} | {r['gpus']} | {_h(r['wall_s'])} | {_h(r['ideal_s'])} | {r['empty_shards']} |")
    for r in p["rows"]:
        if r["gpus"] > 1:
            ratio = r["wall_s"] / r["ideal_s"]
            print(f"projected wall {r['bound']} gpus={r['gpus']}: {r['wall_s']} s (imbalance {ratio:.2f}x)")


def cpu(shards: int, out: Path) -> dict:
    """Wall seconds of the CPU matrix unsharded, then as `shards` shard processes in parallel."""
    matrix = ROOT / "fixtures/matrix/cpu_small.toml"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out.mkdir(parents=True, exist_ok=False)
    argv = [sys.executable, "-m", "tracekit", "run", str(matrix)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run(argv + ["--out", str(out / "whole")], env=env, capture_output=True, check=False)
    whole = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            argv + ["--out", str(out / f"s{i}"), "--shard", f"{i}/{shards}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for i in range(shards)
    ]
    for p in procs:
        p.wait()
    sharded = time.perf_counter() - t0
    return {"cpus": os.cpu_count(), "unsharded_s": round(whole, 1), f"shards{shards}_s": round(sharded, 1),
            "load_avg_1min": [load0, load1, os.getloadavg()[0]]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="also time the CPU matrix unsharded and sharded (minutes)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/shard_bench"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    p = projection()
    if a.cpu:
        p["cpu"] = cpu(a.shards, a.out)
    if a.json:
        print(json.dumps(p, indent=1))
        return
    print_projection(p)
    if a.cpu:
        c = p["cpu"]
        print(f"cpu matrix on {c['cpus']} CPUs: unsharded {c['unsharded_s']} s, {a.shards} shards in parallel "
              f"{c[f'shards{a.shards}_s']} s (load average {c['load_avg_1min']})")  # fmt: skip


if __name__ == "__main__":
    main()
