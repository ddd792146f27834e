"""llama.cpp's CUDA `llama-server` as the study's second engine, at real shapes, in one device call.

    bash bench/gpu_study/pack_llama_src.sh            # here: .llama-pack/ (git-ignored), carried
    PYTHONPATH=.:.llama-pack/gguf-py python bench/gpu_study/llamacpp_cuda.py \\
        --src .llama-pack/llama.cpp-src.tar.gz --out $OUT/llamacpp_cuda --models qwen3-0.6b,qwen3-4b
    # a second call on the still-warm machine reuses the build and models in .llcuda-work/:
    PYTHONPATH=.:.llama-pack/gguf-py python bench/gpu_study/llamacpp_cuda.py \\
        --src .llama-pack/llama.cpp-src.tar.gz --out $OUT/llamacpp_cuda8b --models llama3-8b:bf16
    # the CPU dry run: a given binary, --smoke models, CPU everywhere
    PYTHONPATH=.:.llama-pack/gguf-py python bench/gpu_study/llamacpp_cuda.py --smoke --device cpu \\
        --llama-server ~/.cache/tracekit/llama-server/0.3.36/llama-server --models qwen3-0.6b,llama3-8b --out /tmp/llo

Phases (timings on stderr; a failed cell is recorded and the next one runs):
  build    cmake + build of llama-server with CUDA for sm_90 from the stripped source archive of
           pack_llama_src.sh, in the background (-j16, ~5.5 min); skipped with --llama-server
  models   models.py's random-weight builds (real configs, RANDOM weights), then the GGUF F32 and
           BF16 conversions (scripts/convert_tiny_to_gguf.py, one process each, in the background)
  cells    model x dtype x -np: one llama-server each (f32: -fa off, F32 KV cache; bf16: its
           defaults); serial1, burst1 (concurrency = -np), then --repeats more serial/burst pairs;
           16 prompts of study_128.jsonl, 32 tokens, greedy, ignore_eos, top-20, cache_prompt off
  refs     the FP32 teacher-forced `full` replay of each cell's serial1 through HF transformers
           (calibrated.reference; reused when another cell's serial1 has the same tokens), in a
           background thread while the next cells capture
  verdicts calibrate on the repeats' (serial_r, burst_r) pairs (the same kind of pair as judged),
           judge (serial1, burst1) plain, calibrated, calibrated + reference (calibrated.verdict)
Writes under --out: summary.json, report.md, cells.md, one directory a cell (cal.json, diff JSONs,
server log tail, the judged pair's traces and their reference, ~0.6 MB); the rest stays under --work.
--deadline-s (480) starts no cell later; --hard-stop-s (575) judges without a replay not done by
then, so a 600 s device call returns its results. Disk: a model's GGUFs are deleted after its cells;
all conversions happen up front, so Qwen3-0.6B + 4B (~37 GB at the peak) and Llama-3-8B (one dtype:
32 or 48 GB) go in separate calls on a 64 GB disk. It changes nothing in tracekit.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu_study import calibrated as cal  # noqa: E402  log, Phase, reference, verdict
from bench.gpu_study.llamacpp_report import WEIGHTS, cells_table, report  # noqa: E402

PROMPTS = ROOT / "fixtures" / "prompts" / "study_128.jsonl"
CONVERT = ROOT / "scripts" / "convert_tiny_to_gguf.py"
# scripts/build_llama_server.sh's offline flags, plus CUDA for the H200 (sm_90)
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_CUDA=ON",
    "-DCMAKE_CUDA_ARCHITECTURES=90",
]
F32_FLAGS = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")  # F32 GGUF, no flash attention, F32 KV cache
log = cal.log


def _load_llamacpp():
    spec = importlib.util.spec_from_file_location("llamacpp", ROOT / "scripts" / "llamacpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def start_build(
    src: Path, work: Path, jobs: int, flags: list[str] = CMAKE_FLAGS, target: str = "llama-server"
) -> tuple[subprocess.Popen, Path]:
    """Unpack the archive and build llama-server in the background; (process, binary path).
    (`flags` and `target` let the CPU dry run check the unpack and the configure step.)"""
    s, b = work / "src", work / "build"
    shutil.rmtree(s, ignore_errors=True)
    s.mkdir(parents=True)
    script = f"set -e; tar -xzf {src} -C {s}; cmake -S {s}/llama.cpp -B {b} {' '.join(flags)}; "
    script += f"cmake --build {b} --target {target} -j{jobs}"
    logf = open(work / "build.log", "w")
    proc = subprocess.Popen(["bash", "-c", script], stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, b / "bin" / "llama-server"


def build_model(name: str, models: Path, device: str, smoke: bool) -> Path:
    """models.py's build (reused when the directory is complete and of the same --smoke)."""
    from bench.gpu_study import models as models_mod

    d = models / name
    info = d / "build_info.json"
    if info.exists() and any(d.glob("*.safetensors")) and json.loads(info.read_text()).get("smoke") == smoke:
        log(f"model {d}: reused")
        return d
    import torch

    model = models_mod.build(name, device, smoke)  # BF16, peaked LM head, seed 0
    models_mod.save(model, name, models, smoke)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return d


def start_convert(model_dir: Path, dtype: str, out: Path) -> subprocess.Popen:
    """The converter in its own process (it streams tensor by tensor); PYTHONPATH names gguf-py."""
    logf = open(out.with_suffix(".log"), "w")
    cmd = [sys.executable, str(CONVERT), str(model_dir), str(out), "--outtype", dtype]
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)


def server_extra(dtype: str, device: str) -> tuple:
    ngl = ("-ngl", "999") if device == "cuda" else ("-ngl", "0")
    return (*(F32_FLAGS if dtype == "f32" else ()), *ngl, "--metrics")


def models_meta(url: str) -> dict:
    """GET /v1/models: the served model's `meta` (ftype, n_params, ...) as llama-server reports it."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        data = json.loads(r.read())
    rows = data.get("data") or data.get("models") or [{}]
    return rows[0].get("meta") or {}


def capture(url: str, out: Path, concurrency: int, a, tokenizer: Path) -> dict:
    from tracekit.capture.http import CaptureConfig, run_capture

    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cfg = CaptureConfig(
        url=url,
        prompts=str(PROMPTS),
        out=str(out),
        concurrency=concurrency,
        max_tokens=a.max_tokens,
        ignore_eos=True,
        top_logprobs=20,
        progress=False,
        tokenizer=str(tokenizer),
        cache_prompt=a.cache_prompt == "on",
    )
    t = time.perf_counter()
    s = run_capture(cfg)
    wall = time.perf_counter() - t
    if s.failed:
        raise RuntimeError(f"{out.name}: {s.failed} failed requests: {s.failures[:3]}")
    return {"trace": str(out), "wall_s": round(wall, 2), "tokens": s.tokens, "tok_s": round(s.tokens / wall, 1)}


def signature(trace: str) -> tuple:
    """The trace's (key, generated ids) rows: two serial runs with one signature share a reference."""
    from tracekit.store import TraceReader

    with TraceReader(trace) as r:
        n = len(r.requests)
        return tuple(sorted((r.record(i).key, r.tokens(i).token_id.tobytes()) for i in range(n)))


def trace_dtype(trace: str) -> dict:
    from tracekit.store import TraceReader

    with TraceReader(trace) as r:
        return {k: r.meta.run.get(k) for k in ("dtype", "dtype_source")}


def run_cell(binary: str, gguf: Path, model_dir: Path, dtype: str, np_: int, a, cdir: Path, llamacpp) -> dict:
    """One server, its captures; the record of the cell (the traces' paths, speeds, the dtype)."""
    extra = (*server_extra(dtype, a.device), "-t", str(a.threads))  # the last -t wins over start_server's
    slot_ctx = 512  # 128-token prompts + 32 generated, per slot
    rec = {"flags": f"-np {np_} -c {np_ * slot_ctx} " + " ".join(extra)}
    llamacpp_log = a.work / "logs" / f"{cdir.name}.llama-server.log"  # the tail goes under --out
    llamacpp_log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    srv = llamacpp.start_server(binary, gguf, slots=np_, ctx=np_ * slot_ctx, extra=extra, log_path=str(llamacpp_log))
    with srv as eng:
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        rec["meta"] = models_meta(eng.url)
        caps = {}
        for r in range(1, a.repeats + 2):
            caps[f"serial{r}"] = capture(eng.url, a.work / "traces" / cdir.name / f"serial{r}.h5", 1, a, model_dir)
            caps[f"burst{r}"] = capture(eng.url, a.work / "traces" / cdir.name / f"burst{r}.h5", np_, a, model_dir)
            log(f"  {cdir.name} r{r}: serial {caps[f'serial{r}']['tok_s']} tok/s, burst {caps[f'burst{r}']['tok_s']}")
    rec["captures"] = caps
    rec["dtype_recorded"] = trace_dtype(caps["serial1"]["trace"])
    (cdir / "llama-server.log.tail").write_text(Path(llamacpp_log).read_text(errors="replace")[-6000:])
    return rec


def judge(rec: dict, ref: str | None, cdir: Path, name: str) -> None:
    """Calibrate on the repeats, judge (serial1, burst1); the diff JSONs beside the cell. Without a
    reference (its replay failed) the plain and calibrated verdicts still come."""
    from tracekit.analyze.calibrate import measure
    from tracekit.calibration import write_calibration

    c = rec["captures"]
    n = len(c) // 2
    same = [signature(c[f"serial{r}"]["trace"]) == signature(c["serial1"]["trace"]) for r in range(2, n + 1)]
    pairs = [(c[f"serial{r}"]["trace"], c[f"burst{r}"]["trace"]) for r in range(2, n + 1)]
    with_ref = ref is not None and all(same)  # the replay is of serial1's tokens
    calib = measure(pairs, name=name, reference=ref if with_ref else None)
    write_calibration(calib, cdir / "cal.json")
    rec["calibration"] = {"line": calib.describe(), "pairs": [[Path(x).stem, Path(y).stem] for x, y in pairs]}
    rec["calibration"]["with_reference"] = with_ref
    rec["serial_repeats_same_tokens"] = same
    a, b = Path(c["serial1"]["trace"]), Path(c["burst1"]["trace"])
    modes = cal.MODES if ref is not None else [m for m in cal.MODES if "ref" not in m]
    rec["verdicts"] = [cal.verdict(a, b, m, calib, Path(ref or "-")) for m in modes]
    rec["verdicts"].append(cal.verdict(a, Path(c["serial2"]["trace"]), "plain", calib, Path(ref or "-")))
    for v in rec["verdicts"]:
        (cdir / f"diff_{v['a']}_{v['b']}_{v['mode']}.json").write_text(json.dumps(v, indent=1, default=str))


def parse_models(spec: str, dtypes: list[str]) -> dict[str, list[str]]:
    """`qwen3-4b,llama3-8b:bf16` -> {name: dtypes}; a name without `:D` gets every --dtypes."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, ds = item.partition(":")
        out[name] = ds.split("+") if ds else list(dtypes)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="small outputs (tables, JSON, report.md)")
    ap.add_argument(
        "--work",
        default=str(ROOT / ".llcuda-work"),
        help="models, GGUFs, the build, traces (default: a git-ignored folder of the checkout, which a warm "
        "device machine keeps between calls: a second call reuses the build and the models)",
    )
    ap.add_argument("--src", help="pack_llama_src.sh's llama.cpp-src.tar.gz (built with CUDA)")
    ap.add_argument("--llama-server", help="use this binary; no build")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b", help="NAME[:f32+bf16],... e.g. llama3-8b:bf16")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--slots", default="4,8", help="-np values; the burst's concurrency is the same")
    ap.add_argument("--device", default="cuda", help="cuda: -ngl 999 and HF on the GPU; cpu: the dry run")
    ap.add_argument("--smoke", action="store_true", help="models.py --smoke shapes (CPU dry run)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="serial/burst pairs after the judged one (calibrate)")
    ap.add_argument("--cache-prompt", choices=("on", "off"), default="off")
    ap.add_argument("--threads", type=int, help="llama-server -t (default: 2 on cpu, 8 on cuda)")
    ap.add_argument("--jobs", type=int, default=16, help="build parallelism")
    ap.add_argument("--deadline-s", type=float, default=480, help="start no cell after this many seconds")
    ap.add_argument("--hard-stop-s", type=float, default=575, help="references not done by then: verdicts without them")
    ap.add_argument("--no-traces", action="store_true", help="do not copy serial1/burst1/ref traces to --out")
    ap.add_argument("--keep-gguf", action="store_true", help="keep each model's GGUFs after its cells")
    ap.add_argument(
        "--one-gguf-at-a-time",
        action="store_true",
        help="convert each dtype just before its cells and delete it after (an 8B model's F32 and BF16 GGUFs "
        "beside its safetensors do not fit a 64 GB disk)",
    )
    a = ap.parse_args(argv)
    if not (a.src or a.llama_server):
        ap.error("give --src ARCHIVE (build with CUDA) or --llama-server BINARY")
    if a.repeats < 1:
        ap.error("--repeats must be >= 1 (the calibration's pairs)")
    a.work, out = Path(a.work).resolve(), Path(a.out)
    a.threads = a.threads or (8 if a.device == "cuda" else 2)
    a.work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    models = parse_models(a.models, a.dtypes.split(","))
    slots = [int(x) for x in a.slots.split(",")]
    llamacpp = _load_llamacpp()
    times, doc = {}, {"cells": {}, "errors": []}
    t_start = time.perf_counter()

    build = None
    built = a.work / "build" / "bin" / "llama-server"
    if a.llama_server:
        binary = a.llama_server
    elif built.exists():  # an earlier call's build on this (warm) machine
        binary = str(built)
        log(f"llama-server {built}: reused")
    else:
        with cal.Phase("build_start", times):
            build, binary = start_build(Path(a.src).resolve(), a.work, a.jobs)
    dirs, convs = {}, {}
    with cal.Phase("models", times):
        for name, dts in models.items():
            try:
                dirs[name] = build_model(name, a.work / "models", a.device, a.smoke)
                for dt in dts:
                    g = a.work / "gguf" / f"{name}-{dt}.gguf"
                    g.parent.mkdir(parents=True, exist_ok=True)
                    lazy = a.one_gguf_at_a_time and dt != dts[0]  # started after the previous dtype's cells
                    convs[(name, dt)] = (g, None if g.exists() or lazy else start_convert(dirs[name], dt, g))
            except Exception as e:  # noqa: BLE001  keep going: the other models still run
                doc["errors"].append(f"model {name}: {e!r}")
                log(f"model {name} FAILED: {e!r}")
    with cal.Phase("convert_wait", times):
        for (name, dt), (g, p) in convs.items():
            if p is not None and p.wait() != 0:
                doc["errors"].append(f"convert {name} {dt}: exit {p.returncode}; see {g.with_suffix('.log')}")
            elif g.exists():
                log(f"gguf {g.name}: {g.stat().st_size / 1e6:.1f} MB")
    if build is not None:
        with cal.Phase("build_wait", times):
            rc = build.wait()
            if rc != 0 or not Path(binary).exists():
                tail = (a.work / "build.log").read_text(errors="replace")[-3000:]
                (out / "build.log.tail").write_text(tail)
                doc["errors"].append(f"build failed (exit {rc}); see build.log.tail")
                binary = None
    doc["binary_version"] = "–"
    if binary and not os.access(binary, os.X_OK):
        doc["errors"].append(f"llama-server {binary}: not an executable file")
        binary = None
    if binary:
        v = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        doc["binary_version"] = " ".join((v.stdout + v.stderr).split())[-200:]
        log(f"llama-server {binary}: {doc['binary_version']}")
    refs: dict[str, list] = {}  # model -> [(signature, future)]
    pool = cf.ThreadPoolExecutor(max_workers=1)  # one teacher-forced replay at a time

    def ref_for(name: str, serial: str, cdir: Path):
        sig = signature(serial)
        for s, fut in refs.setdefault(name, []):
            if s == sig:
                return fut
        fut = pool.submit(cal.reference, dirs[name], Path(serial), a.device, a.work / "refs" / cdir.name)
        refs[name].append((sig, fut))
        return fut

    pending = []
    with cal.Phase("cells", times):
        for name, dts in models.items():
            for dt in dts:
                g = convs.get((name, dt), (None,))[0]
                if a.one_gguf_at_a_time and g is not None and not g.exists() and binary:
                    if time.perf_counter() - t_start <= a.deadline_s:
                        if start_convert(dirs[name], dt, g).wait() != 0:
                            doc["errors"].append(f"convert {name} {dt}: failed; see {g.with_suffix('.log')}")
                        else:
                            log(f"gguf {g.name}: {g.stat().st_size / 1e6:.1f} MB")
                for np_ in slots:
                    cname = f"{name}.{dt}.np{np_}"
                    cdir = out / cname
                    cdir.mkdir(exist_ok=True)
                    g = convs.get((name, dt), (None,))[0]
                    if time.perf_counter() - t_start > a.deadline_s:
                        doc["cells"][cname] = {"error": "skipped: past --deadline-s"}
                        continue
                    if not binary or g is None or not g.exists():
                        doc["cells"][cname] = {"error": "no llama-server binary or no GGUF"}
                        continue
                    t = time.perf_counter()
                    try:
                        rec = run_cell(str(binary), g, dirs[name], dt, np_, a, cdir, llamacpp)
                        pending.append((cname, name, ref_for(name, rec["captures"]["serial1"]["trace"], cdir)))
                        doc["cells"][cname] = rec
                    except Exception as e:  # noqa: BLE001  record it, run the next cell
                        doc["cells"][cname] = {"error": repr(e)[:2000]}
                        (cdir / "error.txt").write_text(traceback.format_exc())
                        log(f"cell {cname} FAILED: {e!r}"[:500])
                    log(f"cell {cname}: {time.perf_counter() - t:.1f} s")
                if a.one_gguf_at_a_time and not a.keep_gguf and g is not None:
                    g.unlink(missing_ok=True)  # the next dtype's disk
            if not a.keep_gguf:
                for dt in dts:
                    if (name, dt) in convs:
                        convs[(name, dt)][0].unlink(missing_ok=True)  # the next model's disk
    with cal.Phase("refs_and_verdicts", times):
        for cname, name, fut in pending:
            rec = doc["cells"][cname]
            ref = None
            try:
                left = max(1.0, a.hard_stop_s - (time.perf_counter() - t_start))
                ref = rec["reference"] = str(fut.result(timeout=left))
            except Exception as e:  # noqa: BLE001  the verdicts without it
                rec["reference_error"] = repr(e)[:2000]
                log(f"reference {cname} FAILED: {e!r}"[:500])
            if not a.no_traces:  # the judged pair and its reference (~0.2 MB each at 16 x 32 tokens)
                (out / cname / "traces").mkdir(exist_ok=True)
                for src in [rec["captures"]["serial1"]["trace"], rec["captures"]["burst1"]["trace"], ref]:
                    if src:
                        shutil.copy(src, out / cname / "traces" / Path(src).name)
            try:
                judge(rec, ref, out / cname, f"llamacpp-{a.device}-{cname}")
            except Exception as e:  # noqa: BLE001
                rec["judge_error"] = repr(e)[:2000]
                (out / cname / "judge_error.txt").write_text(traceback.format_exc())
                log(f"verdicts {cname} FAILED: {e!r}"[:500])
    pool.shutdown(wait=False, cancel_futures=True)
    doc |= {
        "weights": WEIGHTS,
        "device": a.device,
        "models": models,
        "slots": slots,
        "prompts": str(PROMPTS.relative_to(ROOT)),
        "max_tokens": a.max_tokens,
        "repeats": a.repeats,
        "cache_prompt": a.cache_prompt,
        "smoke": a.smoke,
        "seconds": times | {"total": round(time.perf_counter() - t_start, 1)},
        "command": " ".join(sys.argv),
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "cells.md").write_text(cells_table(doc))
    md = report(doc)
    (out / "report.md").write_text(md)
    print(md)
    log(f"wrote {out}/summary.json, report.md, cells.md; errors: {doc['errors'] or 'none'}")
    if any(not f.done() for _, _, f in pending):  # a replay still running: do not wait for it at exit
        log("a reference replay is still running; exiting without it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
