"""Turn the GPU job's output directories into the committed evidence under traces/gpu-h200/.

    PYTHONPATH=. python bench/gpu_study/summarize.py --study DIR [--study DIR ...] --dst traces/gpu-h200

Copies each run directory's report (report.md, summary.json, plots), its JSON records
(manifest, cells, checks, diffs, engine records) and a few small traces named by
--keep-cells; writes summary.json (every figure of the job in one document) and the
tables of README.md's "Figures" section (figures.md). Full run directories (about 25 MB
of traces) are not committed. Nothing here needs a GPU or torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from bench.gpu_study import lanes as lanes_mod
from tracekit.store import TraceReader

KEEP_CELLS = ("qwen3-4b.bf16.cache-off.in128.out32.c4", "qwen3-4b.bf16.cache-on.in128.out32.c4")


def gap_stats(run: Path) -> dict:
    """BF16 serial baselines: top-2 gap of the raw logits at every generated position."""
    out = {}
    for serial in sorted(run.glob("groups/*.bf16.*/serial.h5")):
        target = serial.parent.name.split(".")[0]
        with TraceReader(serial) as r:
            logits = r.column("topk_logit")  # [N, k] exact BF16 values
            ids = r.column("token_id")
        gap = logits[:, 0] - logits[:, 1]
        s = out.setdefault(target, {"gaps": [], "ids": []})
        s["gaps"].append(gap)
        s["ids"].append(ids)
    res = {}
    for t, s in out.items():
        g, ids = np.concatenate(s["gaps"]), np.concatenate(s["ids"])
        res[t] = {
            "positions": int(g.size),
            "median_top2_gap_nats": round(float(np.median(g)), 4),
            "exact_tie_rate": round(float((g == 0).mean()), 5),
            "distinct_generated_tokens": int(np.unique(ids).size),
        }
    return res


def copy_run(run: Path, dst: Path, keep_cells=KEEP_CELLS) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("manifest.json", "matrix.toml"):
        shutil.copy(run / name, dst / name)
    shutil.copytree(run / "report", dst / "report", dirs_exist_ok=True)
    for p in run.glob("engines/*.json"):
        (dst / "engines").mkdir(exist_ok=True)
        shutil.copy(p, dst / "engines" / p.name)
    for cell in sorted((run / "cells").iterdir()):
        to = dst / "cells" / cell.name
        to.mkdir(parents=True, exist_ok=True)
        for p in cell.glob("*.json"):
            shutil.copy(p, to / p.name)
        if cell.name in keep_cells:
            for p in cell.glob("*.h5"):
                shutil.copy(p, to / p.name)
            doc = json.loads((cell / "cell.json").read_text())
            base = run / doc["baseline"]
            (dst / base.parent.relative_to(run)).mkdir(parents=True, exist_ok=True)
            shutil.copy(base, dst / base.relative_to(run))


def matrix_figures(run: Path) -> dict:
    s = json.loads((run / "report" / "summary.json").read_text())
    by: dict = {}
    for c in s["cells"]:
        k = by.setdefault(f"{c['target']} {c['dtype']}", {"cells": 0, "pairs": 0, "identical": 0, "classes": {}})
        k["cells"] += 1
        eq = c["equality"].split("/")
        k["identical"] += int(eq[0])
        k["pairs"] += int(eq[1])
        for cls, n in (c["classes"] or {}).items():
            if cls not in ("pairs", "identical") and n:
                k["classes"][cls] = k["classes"].get(cls, 0) + n
    return {"totals": s["totals"], "failed_cells": s["failed_cells"], "by_target_dtype": by}


def figures_md(doc: dict) -> str:
    lines = ["### Tie statistics (random weights, BF16, 16 x 128 prompt positions)", ""]
    lines += [
        "| model | params | default 0.02 init: median top-2 gap / exact ties | peaked: median gap / exact ties "
        "/ within 1 BF16 step / median top-1 prob / median top-1 logit | generated positions (serial BF16 "
        "baselines): median gap / exact ties / distinct tokens |",
        "|---|---|---|---|---|",
    ]
    for name, m in doc["ties"]["models"].items():
        d, p = m["default_init"], m["peaked"]
        gen = doc["generated_gaps"].get(name.replace("qwen3-0.6b", "qwen3-06b"))
        gtxt = (
            "—"
            if gen is None
            else (f"{gen['median_top2_gap_nats']} / {gen['exact_tie_rate']:.2%} / {gen['distinct_generated_tokens']}")
        )
        lines.append(
            f"| {name} | {m['params'] / 1e9:.2f}B | {d['median_top2_gap_nats']} / {d['exact_tie_rate']:.2%} | "
            f"{p['median_top2_gap_nats']} / {p['exact_tie_rate']:.2%} / {p['within_one_bf16_step_rate']:.2%} / "
            f"{p['median_top1_prob']} / {p['median_top1_logit']} | {gtxt} |"
        )
    lines += ["", "### Study matrix (serial c1 vs burst, same engine process)", ""]
    lines += ["| run | target dtype | cells | identical / pairs | classes of the others |", "|---|---|---|---|---|"]
    for run, m in doc["matrix"].items():
        for k, v in m["by_target_dtype"].items():
            cls = ", ".join(f"{n} {c}" for c, n in v["classes"].items()) or "—"
            lines.append(f"| {run} | {k} | {v['cells']} | {v['identical']}/{v['pairs']} | {cls} |")
    if doc.get("lanes"):
        lines += ["", "### B1 vs B4 (qwen3-4b shape, BF16, 8,192 in / 128 out, c=16, timeout 180 s)", ""]
        lines += [lanes_mod.table(doc["lanes"]), "", lanes_mod.memory_table(doc["lanes"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", action="append", required=True, help="a job's --out directory (repeatable)")
    ap.add_argument("--dst", required=True)
    a = ap.parse_args(argv)
    dst = Path(a.dst)
    dst.mkdir(parents=True, exist_ok=True)
    doc: dict = {"models": "real configs, RANDOM weights (seed 0, peaked LM head): not trained models"}
    doc.update(matrix={}, generated_gaps={})
    for i, src in enumerate(map(Path, a.study)):
        tag = "study" if i == 0 else f"study{i + 1}"
        for name in ("ties", "checks", "repro", "phases"):
            p = src / f"{name}.json"
            if p.exists():
                doc.setdefault(name, {})[tag] = json.loads(p.read_text())
        if (src / "lanes" / "lanes.json").exists():
            doc["lanes"] = json.loads((src / "lanes" / "lanes.json").read_text())
            shutil.copy(src / "lanes" / "lanes.json", dst / "lanes.json")
        run = src / "run"
        copy_run(run, dst / tag)
        doc["matrix"][tag] = matrix_figures(run)
        for t, g in gap_stats(run).items():
            doc["generated_gaps"].setdefault(t, g)
    doc["ties"] = next(iter(doc["ties"].values())) if "ties" in doc else None
    if doc["ties"] is None:
        raise SystemExit("Error: no ties.json in any --study directory")
    (dst / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (dst / "figures.md").write_text(figures_md(doc))
    print(figures_md(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
