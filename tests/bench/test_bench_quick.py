"""Every bench runs in CI: each bench/*.py and bench/gpu_study/*.py in its smallest mode, as a
subprocess, must exit 0 and print its figures (the ratios it exists to measure).

This catches benches broken by API changes (bench/engine_bench.py once died on a renamed
attribute). Timing never fails here: a figure only has to be printed, whatever its value.
Benches that need CUDA (or several GPUs) are skipped with the reason; bench/gpu_study runs
through its CPU smoke modes (--smoke, --device cpu). A new bench is added to CASES or SKIPPED
(test_every_bench_is_run_or_skipped_with_a_reason)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM = r"-?\d+(\.\d+)?"

# A case: the steps it runs in order, each (script under bench/, argv, regexes its stdout+stderr
# must match); {tmp} is the test's tmp_path (a later step reads what an earlier one wrote).
# Sizes: the bench's --quick, or its own options set smaller where --quick is over a minute on
# 2 cores (sensitivity) or the bench has no --quick (batch_invariant, grid_noise, crash).
CASES: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "store_bench": [
        ("store_bench.py", ["--quick"], [rf"bytes_vs_raw \(target <= 1.2\)\s*\|\s*{NUM}", rf"read_vs_npy.*\|\s*{NUM}"])
    ],
    "shard_bench": [("shard_bench.py", [], [rf"projected wall gpu_s_per_cell gpus=64: {NUM} s"])],
    "diff_bench": [("diff_bench.py", ["--quick"], [rf"{NUM}x slower", rf"diff = {NUM}x floor"])],
    "diff_bench_scaling": [
        (
            "diff_bench.py",
            ["--scaling", "--sizes", "1e4", "--repeats", "1"],
            [r"10,000 +\d", r"classes match at every size"],
        )
    ],
    "engine_bench": [
        ("engine_bench.py", ["--quick", "--repeats", "1"], [rf"speedup_c8 = {NUM}", rf"without HTTP: {NUM}"])
    ],
    "capture_bench": [
        (
            "capture_bench.py",
            ["--quick"],
            [
                rf"cpu_per_token_vs_bare_c64: {NUM} \(per turn {NUM}-{NUM}\)",
                rf"stepped_cpu_per_token_vs_bare_c64: {NUM}",
            ]
            + [rf"keep_floor_vs_bare_c64: {NUM}", rf"stepped_read_vs_bare_c64: {NUM}"],
        )
    ],
    # run_all: every headline ratio against its target in one table (issue 25); here two of its
    # benches (each bench's own case above runs it anyway): the table, not the figures, is checked
    "run_all": [
        (
            "run_all.py",
            ["--quick", "--only", "store,capture", "--out", "{tmp}/run_all.json"],
            [rf"\| store \| read_vs_npy \| {NUM} \| <= 2 \| (yes|no) \|"]
            + [rf"\| capture \| cpu_per_token_vs_bare_c64 \| {NUM} \| <= 1.3 \| (yes|no) \|"],
        )
    ],
    "capture_soak": [("capture_soak.py", ["--quick"], [rf"rss_growth\s+{NUM}", r"ok\s+True"])],
    "soak": [("soak.py", ["--quick"], [rf"rss_growth\s+{NUM}", r"ok\s+True"])],
    "sensitivity": [
        (
            "sensitivity.py",
            ["--quick", "--eps", "1e-2,1.0", "--runs", "2", "--max-tokens", "8", "--reference"],
            [rf"detect_eps {NUM}\s+false_alarm_rate {NUM}"]
            + [r"detect_eps_judged (\S+)\s+held-out healthy runs failed \d+/1"],
        )
    ],
    "diagnostic_bench": [("diagnostic_bench.py", ["--quick"], [rf"vs_independent_forwards \(worst\) = {NUM}"])],
    "batch_invariant": [("batch_invariant.py", ["--max-tokens", "4"], [rf'"throughput_ratio_c8": {NUM}'])],
    "grid_noise": [
        ("grid_noise.py", ["--max-tokens", "4", "--dtypes", "fp32"], [rf"mean tolerance needed \(max 0.5\): {NUM}"])
    ],
    # --repeat 1: the capture's keys then carry no #r suffix (the bench's plan once missed them)
    "crash": [
        (
            "crash.py",
            ["--kills", "1", "--run-kills", "1", "--repeat", "1"],
            [r"capture: 1/1 kills survived", r"run: 1/1"],
        )
    ],
    "gpu_study_models": [
        (
            "gpu_study/models.py",
            ["--out", "{tmp}/models", "--models", "qwen3-0.6b", "--stats-only", "", "--smoke"],
            [rf"median_top2_gap_nats': {NUM}"],
        )
    ],
    "gpu_study_tp": [
        (
            "gpu_study/tp.py",
            ["--out", "{tmp}/tp", "--models-dir", "{tmp}/models", "--model", "qwen3-0.6b", "--prompts", "1"]
            + ["--max-tokens", "4", "--device", "cpu", "--backend", "gloo", "--smoke"],
            [rf"fp32 full: .* max\|dlogit\| {NUM}"],
        ),
        ("gpu_study/tp_compare.py", ["{tmp}/tp/tp1.h5", "{tmp}/tp/tp2.h5"], [rf"max \|dlogit\| over top-k {NUM}"]),
    ],
    # study.py's phases in two cases of about a minute each (all five in one: ~2 minutes on 2 cores)
    "gpu_study_study_checks": [
        (
            "gpu_study/study.py",
            ["--out", "{tmp}/study", "--models-dir", "{tmp}/models", "--device", "cpu", "--smoke"]
            + ["--phases", "build,checks,repro", "--build-models", "qwen3-0.6b,qwen3-4b"],
            [r"phase checks: done", r"phase repro: done", r"all phases done"],
        ),
    ],
    "gpu_study_study_matrix": [
        (
            "gpu_study/study.py",
            ["--out", "{tmp}/study", "--models-dir", "{tmp}/models", "--device", "cpu", "--smoke"]
            + ["--phases", "build,matrix,lanes", "--build-models", "qwen3-0.6b", "--targets", "qwen3-06b"],
            [r"phase matrix: done", r"phase lanes: done", r"all phases done"],
        ),
        ("gpu_study/summarize.py", ["--study", "{tmp}/study", "--dst", "{tmp}/summary"], [rf"\| predicted .*\| {NUM}"]),
    ],
    "gpu_study_calibrated": [
        (
            "gpu_study/calibrated.py",
            ["--smoke", "--out", "{tmp}/cal"],
            [r"\| serial1 vs c8_3 \| cal\+ref \| pairs 16.*\| (True|False) \| run-level flip test"]
            + [r"phase verdicts: done"],
        )
    ],
    "gpu_study_decode_graphs": [
        (
            "gpu_study/decode_graphs.py",
            ["--smoke", "--out", "{tmp}/dg", "--fusion"],
            [r"\| B8 padded \| 8 \| 100-128 \| 4 \| True \| 0 \|", r"\| B1 \| 1 \| 120-120 \| 4 \| True \| 0 \|"]
            + [rf"\| 4 \| inline \| {NUM} \|", r"groups fused 8, left 0", r"\| B8 padded \| 4 \| True \| 0.0 \|"],
        )
    ],
    "gpu_study_long_cells": [
        (
            "gpu_study/long_cells.py",
            ["--smoke", "--out", "{tmp}/long", "--phases", "gemma_window"],
            [r'"window_mattered": (true|false)', r"phase gemma_window: done"],
        )
    ],
    "gpu_study_diag_chain": [
        ("gpu_study/diag_chain.py", ["--smoke", "--out", "{tmp}/dc"], [r'"mode": "inline", "step_ms_runs"'])
    ],
    "gpu_study_decode_fused": [
        (
            "gpu_study/decode_fused.py",
            ["--smoke", "--out", "{tmp}/df", "--engine-model-dir", "tiny"],
            # StaticCache vs the engine's numerics: bitwise on CUDA (traces/gpu-h200/decode_fused/); on a CPU
            # the static cache's longer padded KV may move BF16 logits by a step (0.0312 on an AVX512-BF16
            # EPYC), never the argmax at the smoke's scale
            [r"\| 8 \| eager-static \| 60 \| .* \| 0\.0\d* / 1\.0 / (True|False) \|", r'"mode": "inline", "rows": 8'],
        )
    ],
    "gpu_study_gemm_floor": [
        ("gpu_study/gemm_floor.py", ["--smoke", "--out", "{tmp}/gf", "--rows", "1,8"], [r'"rows": 8, "separate_ms"'])
    ],
    "gpu_study_pair_probe": [
        ("gpu_study/pair_probe.py", ["--smoke", "--out", "{tmp}/pp"], [r"b8-padded \{.*abs_dgap_nats", r"serial err"])
    ],
}
CUDA = "needs CUDA (a GPU job)"
SKIPPED = {
    "decode_repro.py": CUDA,
    "diagnostic_profile.py": CUDA + ": profiles CUDA kernels",
    "multi_gpu_check.py": "needs >= 2 GPUs and accelerate",
    "family_noise.py": "reads the --keep directory of a whole `sensitivity.py --family` run (its figures: RESULTS.md)",
}


def test_every_bench_is_run_or_skipped_with_a_reason():
    """A new bench is added here (its smallest mode, or why CI cannot run it)."""
    found = {str(p.relative_to(ROOT / "bench")) for p in (ROOT / "bench").glob("*.py")}
    found |= {str(p.relative_to(ROOT / "bench")) for p in (ROOT / "bench" / "gpu_study").glob("*.py")}
    found.discard("gpu_study/__init__.py")
    run = {script for steps in CASES.values() for script, _, _ in steps}
    run |= {"gpu_study/engine_checks.py", "gpu_study/lanes.py"}  # study.py's checks and lanes phases
    # sensitivity.py --family [--explain] (imported by it; its full run is bench/RESULTS.md's)
    run |= {"sensitivity_family.py", "sensitivity_explain.py"}
    run |= {"diff_scaling.py"}  # diff_bench.py --scaling (the diff_bench_scaling case)
    run |= {"capture_server.py"}  # capture_bench.py's server process (the capture_bench case)
    # llama.cpp's CUDA job: its CPU dry run below (test_llamacpp_cuda_dry_run; llamacpp_report.py is its tables)
    run |= {"gpu_study/llamacpp_cuda.py", "gpu_study/llamacpp_report.py"}
    assert not run & set(SKIPPED)
    assert found == run | set(SKIPPED)


@pytest.mark.parametrize("script", sorted(SKIPPED))
def test_bench_needs_a_gpu(script):
    pytest.skip(f"{script}: {SKIPPED[script]}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bench_quick_mode_runs(case, tmp_path):
    """Exit 0 and the figures printed; the figures' values are the bench's business, not CI's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for script, args, figures in CASES[case]:
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        r = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=600,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"{script} exited {r.returncode}:\n{out[-4000:]}"
        for pat in figures:
            assert re.search(pat, out), f"{script} did not print /{pat}/:\n{out[-4000:]}"


@pytest.mark.skipif(not os.environ.get("TRACEKIT_LLAMA_SERVER"), reason="needs TRACEKIT_LLAMA_SERVER (CI builds it)")
def test_llamacpp_cuda_dry_run(tmp_path):
    """bench/gpu_study/llamacpp_cuda.py's CPU dry run, one cell: a --smoke Qwen3 converted to an F32
    GGUF, served by the CPU llama-server, captured serially and as a burst, judged (plain, calibrated,
    calibrated + reference), its report written: the GPU job's every part but the CUDA build."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_study" / "llamacpp_cuda.py"), "--smoke", "--device", "cpu"]
    cmd += ["--llama-server", os.environ["TRACEKIT_LLAMA_SERVER"], "--models", "qwen3-0.6b", "--dtypes", "f32"]
    cmd += ["--slots", "4", "--out", str(tmp_path / "llo"), "--no-traces"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "errors: none" in out, out[-4000:]
    report = (tmp_path / "llo" / "report.md").read_text()
    assert re.search(r"\| qwen3-0\.6b\.f32\.np4 \| fp32 \(all F32\) \|", report), report[:3000]
