"""The user's study at real shapes on one GPU, as one background job in phases.

    PYTHONPATH=. python bench/gpu_study/study.py --out /tmp/study --models-dir /tmp/tkm \
        [--device cuda] [--phases build,checks,repro,matrix,lanes] [--smoke]

Phases (each writes its JSON under --out; `progress.log` says where it is):
  build    models.py: the architectures with random weights, peaked LM head, tokenizer;
           tie statistics (median top-2 gap, exact BF16 ties) -> ties.json
  checks   engine_checks.py: decode reproducibility with and without cuDNN's kernel,
           decode step vs its bandwidth floor (4B, 8 rows) -> engine_checks.json
  repro    the same serial BF16 capture on two fresh `tracekit serve --device cuda` -> repro.json
  matrix   fixtures/matrix/study_h200.toml: the targets' engine configurations run in
           PARALLEL (one thread per target, each its own engine process on the shared GPU;
           the cells of one target run in order, as `tracekit run` runs them), then the
           teacher-forced diagnostic of every divergent key on the GPU (one at a time), the
           manifest and `tracekit report` -> run/ (a normal run directory)
  lanes    lanes.py: --slots 1 vs --slots 4, concurrency 16, 8,192 in / 128 out -> lanes/

Throughput figures of the matrix are taken with the other targets' engines sharing the
GPU (the job's point there is numerics); the checks and lanes phases run alone.
Models: real configs, RANDOM weights from a fixed seed (models.py); say so with every table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PROMPTS = ROOT / "fixtures" / "prompts"
MATRIX = ROOT / "fixtures" / "matrix" / "study_h200.toml"
PHASES = ("build", "checks", "repro", "matrix", "lanes")
_LOG: Path | None = None


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if _LOG:
        with _LOG.open("a") as f:
            f.write(line + "\n")


def matrix_for(models_dir: Path, device: str, out: Path, smoke: bool, sets: str = "", targets: str = ""):
    """study_h200.toml with this job's model directory, device and absolute prompt paths."""
    from tracekit.capture.matrix import load_matrix

    text = MATRIX.read_text()
    text = text.replace("/tmp/tkm/", f"{models_dir.resolve()}/").replace('"../prompts/', f'"{PROMPTS}/')
    if device != "cuda":
        text = text.replace('"--device", "cuda"', f'"--device", "{device}"')
    if smoke:  # the CPU check: short prompts only
        sets = "in128"
    if sets:
        text = text.replace('prompts = ["in128", "in2048"]', f"prompts = {json.dumps(sets.split(','))}")
    if targets:  # keep only these [[target]] tables
        head, *tables = text.split("[[target]]")
        text = head + "".join("[[target]]" + t for t in tables if t.split('"')[1] in targets.split(","))
    path = out / "study_matrix.toml"
    path.write_text(text)
    return load_matrix(path)


def run_parallel(m, out: Path, teacher_device: str, commit: str | None) -> None:
    """tracekit.workflows.matrix.run with the targets in parallel threads (same run directory layout)."""
    from tracekit import __version__
    from tracekit.capture.matrix.cells import run_matrix
    from tracekit.rundir import Manifest, RunDir, now_utc
    from tracekit.runinfo import command_line, host_info
    from tracekit.workflows.matrix import TeacherPlan, _diff, _teacher  # this driver is run() with targets in threads

    rd = RunDir.create(out, m.text)
    started = now_utc()
    plan = TeacherPlan(device=teacher_device)
    gpu = threading.Lock()  # the diagnostic captures CUDA graphs: one in this process at a time

    def one(t):
        sub = dataclasses.replace(m, targets=(t,))
        records, engines = run_matrix(sub, rd)
        done = []
        for r in records:
            r = dataclasses.replace(r, diff=_diff(rd, r))
            with gpu:
                try:
                    r = _teacher(rd, sub, r, plan)
                except Exception:  # noqa: BLE001 - keep the cell and its diff; the log says why
                    log(f"teacher-forced step failed on {r.cell.id}:\n{traceback.format_exc()}")
            rd.write_cell(r)
            done.append(r)
        log(f"target {t.name}: {len(done)} cells done")
        return done, engines

    with ThreadPoolExecutor(len(m.targets)) as pool:
        results = list(pool.map(one, m.targets))
    cells = tuple(r.cell.id for done, _ in results for r in done)
    engines = tuple(e for _, engs in results for e in engs)
    man = Manifest(
        f"tracekit {__version__}",
        commit,
        command_line(None),
        host_info(),
        started,
        now_utc(),
        m.name,
        m.path,
        cells,
        engines,
        rd.file_hashes(),
    )
    rd.write_manifest(man)


def phase(name: str, fn, out: Path, results: dict) -> None:
    t0 = time.perf_counter()
    log(f"phase {name}: start")
    try:
        doc = fn()
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
        if doc is not None:
            (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    except Exception:  # noqa: BLE001 - a phase that fails must not stop the next ones
        results[name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 1), "error": traceback.format_exc()}
        log(f"phase {name}: FAILED\n{traceback.format_exc()}")
    log(f"phase {name}: done in {time.perf_counter() - t0:.1f} s")
    (out / "phases.json").write_text(json.dumps(results, indent=1) + "\n")


def main(argv=None) -> int:
    global _LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--smoke", action="store_true", help="CPU check: shrunk configs, short prompts")
    ap.add_argument("--prompt-sets", default="", help="matrix prompt sets (default the file's: in128,in2048)")
    ap.add_argument("--targets", default="", help="matrix targets to run (default all)")
    ap.add_argument("--build-models", default="qwen3-0.6b,qwen3-4b,gemma3-1b")
    ap.add_argument("--commit", default=None, help="the git commit of the code (the GPU copy has no .git)")
    a = ap.parse_args(argv)
    out, models = Path(a.out), Path(a.models_dir)
    out.mkdir(parents=True, exist_ok=True)
    _LOG = out / "progress.log"
    results: dict = {}
    phases = a.phases.split(",")
    bad = [p for p in phases if p not in PHASES]
    if bad:
        print(f"Error: unknown phase(s) {bad}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    from bench.gpu_study import engine_checks, lanes
    from bench.gpu_study import models as models_mod

    p2048 = PROMPTS / ("study_128.jsonl" if a.smoke else "study_2048.jsonl")
    p8192 = PROMPTS / ("study_128.jsonl" if a.smoke else "study_8192.jsonl")
    build_args = ["--out", str(models), "--device", a.device, "--json", str(out / "ties.json")]
    build_args += ["--models", a.build_models, "--stats-only", ""]
    steps = {
        "build": lambda: _build(models_mod, build_args + (["--smoke"] if a.smoke else [])),
        "checks": lambda: engine_checks.main_checks(models, p2048, a.device, small=a.smoke),
        "repro": lambda: engine_checks.serve_repro(
            str(models / "qwen3-0.6b"), str(_subset(p2048, out / "repro_prompts.jsonl", 8)), out / "repro", a.device
        ),
        "matrix": lambda: run_parallel(
            matrix_for(models, a.device, out, a.smoke, a.prompt_sets, a.targets), out / "run", a.device, a.commit
        ),
        "lanes": lambda: lanes.run_lanes(
            str(models / ("qwen3-0.6b" if a.smoke else "qwen3-4b")),
            str(p8192),
            out / "lanes",
            device=a.device,
            **({"max_context": 512, "max_tokens": 16, "concurrency": 4} if a.smoke else {}),
        ),
    }
    for name in phases:
        phase(name, steps[name], out, results)
    if "matrix" in phases and (out / "run" / "manifest.json").exists():
        from tracekit.analyze.run_report import write_report

        write_report(out / "run")
        log("report written: run/report/report.md")
    log("all phases done")
    return 0 if all(r["ok"] for r in results.values()) else 1


def _build(models_mod, args: list[str]) -> None:
    """models.py writes ties.json itself; a non-zero exit is a failed phase."""
    if models_mod.main(args) != 0:
        raise RuntimeError("models.py failed")


def _subset(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return dst


if __name__ == "__main__":
    raise SystemExit(main())
