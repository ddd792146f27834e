"""The cells the study had not run: Qwen3-4B at 8,192-token inputs, a Llama-3-8B shape served,
Gemma3-1B's sliding window at 8,192, and the diagnostic's decode history against the floor.

    PYTHONPATH=. python bench/gpu_study/long_cells.py --out /tmp/long --models-dir /tmp/tkm --device cuda
    python bench/gpu_study/long_cells.py --smoke --out /tmp/longsmoke   # CPU, shrunken configs, 128-token prompts

Every model is a real config with RANDOM weights (models.py), BF16, `tracekit serve` with the
prefix cache off (decode steps as CUDA graphs, bitwise the eager step). A cell: serial and burst
captures of the same prompts (32 tokens, greedy, ignore_eos), the FP32 teacher-forced `full`
replay of the serial one as the reference, `diff` serial vs each burst with the reference:
counts, ok, the reference line. Phases (--phases, comma-separated):
  qwen4b_8192   Qwen3-4B, 8 of study_8192's prompts, concurrency 1 and 4, context 8,256
  llama8b       Llama-3.1-8B shape, study_128's 16 prompts, concurrency 1, 4 and 8
  gemma_window  Gemma3-1B, 4 prompts of 8,192: last-64-position logits with the 512 window and with
                it disabled (did the window matter?), then the cell at 8,192 (concurrency 1 and 4)
  diag_decode   the teacher-forced diagnostic's `decode` history (BF16) on the 4B 8,192 serial
                trace: wall per decode step against the bandwidth floor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
P = ROOT / "fixtures" / "prompts"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def build_saved(models: Path, name: str, device: str, smoke: bool) -> Path:
    import torch

    from bench.gpu_study import models as mm

    d = models / name
    if (d / "build_info.json").exists() and json.loads((d / "build_info.json").read_text()).get("smoke") == smoke:
        return d
    model = mm.build(name, device, smoke=smoke)
    mm.save(model, name, models, smoke=smoke)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"built {name}")
    return d


def subset(src: Path, n: int, out: Path, cut: int | None = None) -> Path:
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()][:n]
    if cut:
        rows = [{**r, "prompt": r["prompt"][:cut]} for r in rows]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def cell(model: Path, prompts: Path, levels: list[int], ctx: int, device: str, out: Path, max_tokens: int = 32):
    """Captures at each level on one engine, the FP32 reference of the serial one, diffs."""
    from tracekit.analyze import diff
    from tracekit.analyze.compare import reference_line
    from tracekit.capture.http import CaptureConfig, run_capture
    from tracekit.engine.process import start_engine

    out.mkdir(parents=True, exist_ok=True)
    args = ["--model", model, "--dtype", "bf16", "--device", device, "--slots", "8", "--no-prefix-cache"]
    args += ["--max-context", str(ctx)]
    traces, times = {}, {}
    with start_engine(args, timeout_s=900, log_path=out / "serve.log") as eng:
        for c in levels:
            t = out / f"c{c}.h5"
            t.unlink(missing_ok=True)
            cfg = CaptureConfig(url=eng.url, prompts=str(prompts), out=str(t), concurrency=c)
            cfg = dataclasses.replace(cfg, max_tokens=max_tokens, ignore_eos=True, top_logprobs=20, progress=False)
            t0 = time.perf_counter()
            s = run_capture(cfg)
            times[f"c{c}"] = round(time.perf_counter() - t0, 2)
            if s.failed:
                raise RuntimeError(f"{t.name}: {s.failed} failed: {s.failures[:3]}")
            traces[c] = t
    ref = out / "ref_fp32_full.h5"
    ref.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tracekit", "capture", "--teacher-forced", str(model), "--from", str(traces[1])]
    cmd += ["--history", "full", "--dtype", "fp32", "--device", device, "--out", str(ref)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    times["reference"] = round(time.perf_counter() - t0, 2)
    verdicts = []
    for c in levels[1:]:
        res = diff(str(traces[1]), str(traces[c]), reference=str(ref))
        verdicts.append(
            {
                "b": f"c{c}",
                "counts": {k: v for k, v in res.counts().items() if v},
                "ok": res.ok,
                "flip_test": None if res.flip_test is None else res.flip_test.line(),
                "reference": None if res.reference is None else reference_line(res.reference),
                "divergent": [
                    {"key": p.key, "class": p.cls, "position": p.position, "rule": p.rule[:200]}
                    for p in res.pairs
                    if p.cls != "identical"
                ],
            }
        )
        log(f"{out.name} serial vs c{c}: {verdicts[-1]['counts']} ok={res.ok}")
    return {"engine": "tracekit serve " + " ".join(map(str, args)), "capture_s": times, "verdicts": verdicts}


def gemma_window(device: str, smoke: bool, prompts: Path) -> dict:
    """Logits of the last 64 positions of 4 long prompts with the sliding window and without it."""
    import torch

    from bench.gpu_study import models as mm

    model = mm.build("gemma3-1b", device, smoke=smoke)
    rows = [json.loads(x)["prompt"] for x in prompts.read_text().splitlines() if x.strip()][:4]
    win = model.config.sliding_window
    res = {"sliding_window": win, "prompt_tokens": len(rows[0]), "positions_compared": 64}

    def last_logits():
        with torch.inference_mode():
            return torch.cat(
                [model(input_ids=torch.tensor([r], device=device)).logits[0, -64:].float().cpu() for r in rows]
            )

    a = last_logits()
    big = 4 * len(rows[0])
    model.config.sliding_window = big
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = big
    b = last_logits()
    model.config.sliding_window = win
    d = (a - b).abs()
    res |= {
        "max_abs_dlogit": round(float(d.max()), 4),
        "mean_abs_dlogit": round(float(d.mean()), 5),
        "top1_agree": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
        "kl_window_vs_full_mean": round(
            float(
                torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none")
                .sum(-1)
                .mean()
            ),
            5,
        ),
    }
    res["window_mattered"] = bool(d.max() > 0)
    model = None  # free it before the cell's engine loads its own copy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def diag_decode(model: Path, serial: Path, device: str, out: Path) -> dict:
    """The teacher-forced diagnostic's decode history in BF16 on the serial trace: wall per step vs floor."""
    import h5py  # noqa: F401 - the store needs it; fail here, clearly, if absent

    from tracekit.store import TraceReader

    with TraceReader(serial) as r:
        n_req = len(r.requests.key)
        tokens = sum(len(r.tokens(i).token_id) for i in range(n_req))

    def one(history: str):
        dst = out / f"diag_{history}.h5"
        dst.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tracekit", "capture", "--teacher-forced", str(model), "--from", str(serial)]
        cmd += ["--history", history, "--dtype", "bf16", "--device", device, "--out", str(dst)]
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        return proc, time.perf_counter() - t0

    p, wall = one("decode")
    p2, wall_full = one("full")
    return {
        "requests": n_req,
        "generated_tokens": tokens,
        "decode_history_wall_s": round(wall, 2),
        "full_history_wall_s": round(wall_full, 2),
        "decode_minus_full_s": round(wall - wall_full, 2),
        "exit_codes": [p.returncode, p2.returncode],
        "stderr_tail": (p.stderr[-600:], p2.stderr[-600:]),
        "note": "process walls (load included); decode - full ~ the decode chain's cost over the same load",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", default="/tmp/tkm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phases", default="gemma_window,qwen4b_8192,diag_decode,llama8b")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device = "cpu"
    out, models = Path(a.out), Path(a.models_dir if not a.smoke else Path(a.out) / "models")
    out.mkdir(parents=True, exist_ok=True)
    long_src = P / ("study_128.jsonl" if a.smoke else "study_8192.jsonl")
    doc: dict = {"weights": "real configs, RANDOM weights (models.py), not trained models", "smoke": a.smoke}
    times = {}
    for ph in a.phases.split(","):
        t0 = time.perf_counter()
        log(f"phase {ph}: start")
        try:
            if ph == "gemma_window":
                doc[ph] = {"logits": gemma_window(a.device, a.smoke, long_src)}
                log(f"gemma window: {doc[ph]['logits']}")
                m = build_saved(models, "gemma3-1b", a.device, a.smoke)
                pr = subset(long_src, 4 if a.smoke else 8, out / "gemma_prompts.jsonl")
                doc[ph]["cell"] = cell(m, pr, [1, 4], 256 if a.smoke else 8256, a.device, out / "gemma3_8192")
            elif ph == "qwen4b_8192":
                m = build_saved(models, "qwen3-4b", a.device, a.smoke)
                pr = subset(long_src, 4 if a.smoke else 8, out / "q4_prompts.jsonl")
                doc[ph] = cell(m, pr, [1, 4], 256 if a.smoke else 8256, a.device, out / "qwen3_4b_8192")
            elif ph == "diag_decode":
                m = build_saved(models, "qwen3-4b", a.device, a.smoke)
                doc[ph] = diag_decode(m, out / "qwen3_4b_8192" / "c1.h5", a.device, out)
                log(f"diag decode: {doc[ph]}")
            elif ph == "llama8b":
                m = build_saved(models, "llama3-8b", a.device, a.smoke)
                doc[ph] = cell(m, P / "study_128.jsonl", [1, 4, 8], 256, a.device, out / "llama3_8b")
            else:
                raise SystemExit(f"unknown phase {ph}")
        except Exception as e:  # noqa: BLE001 - one phase failing must not lose the others' figures
            doc[ph] = {"error": f"{type(e).__name__}: {e}"}
            log(f"phase {ph}: FAILED {e}")
        times[ph] = round(time.perf_counter() - t0, 1)
        log(f"phase {ph}: done in {times[ph]} s")
        (out / "summary.json").write_text(json.dumps(doc | {"seconds": times}, indent=1, default=str) + "\n")
    print(json.dumps(doc | {"seconds": times}, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
