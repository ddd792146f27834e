"""The reference engine on CUDA: reproducibility of its decode, and its decode speed against the floor.

- `chain_repro`: the engine's own executor (prefill, then batched one-token decode
  steps, greedy) run twice on the same prompts, with cuDNN's attention kernel allowed
  (torch's default choice) and with it left out (what the engine does since
  tracekit/engine/kernels.py): max |Δlogit| between the runs, bitwise or not.
- `serve_repro`: the same serial BF16 capture through `tracekit serve --device cuda`
  twice, each on a fresh engine; every request's token ids, chosen logprobs and raw
  top-k logits compared bitwise.
- `decode_speed`: wall time of one batched decode step (B rows) and its device time
  (torch.profiler, kernels only) against the bandwidth floor: every weight byte plus
  the batch's KV bytes read once per step, over the copy bandwidth measured here and
  over the datasheet's 4.8 TB/s.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode_chain(ex, prompts: list[list[int]], steps: int):
    """Fill slots 0..B-1 with the prompts, then `steps` batched greedy decode steps.
    Returns the logits of every step, [steps, B, V] in the model dtype."""
    import torch

    firsts = [int(ex.prefill(s, p, 0).argmax(-1)) for s, p in enumerate(prompts)]
    slots, lengths, nxt = list(range(len(prompts))), [len(p) for p in prompts], firsts
    out = []
    for _ in range(steps):
        logits = ex.decode(slots, lengths, nxt)
        out.append(logits)
        nxt = logits.float().argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    return torch.stack(out)


def chain_repro(ex, prompts: list[list[int]], steps: int = 32) -> dict:
    """Two runs of one chain per kernel setting; max |Δ| and whether bitwise equal."""
    out = {}
    for allow in (True, False):
        ex.allow_cudnn = allow
        a = decode_chain(ex, prompts, steps)
        b = decode_chain(ex, prompts, steps)
        d = (a.float() - b.float()).abs()
        first = (d.flatten(1).amax(1) > 0).nonzero()
        out["cudnn_allowed" if allow else "cudnn_off"] = {
            "bitwise_equal": bool(d.max() == 0),
            "max_abs_diff": float(d.max()),
            "first_differing_step": int(first[0]) if len(first) else None,
            "argmax_differs": int((a.float().argmax(-1) != b.float().argmax(-1)).sum()),
        }
    ex.allow_cudnn = False
    return out


def compare_traces(a: Path, b: Path) -> dict:
    """Per key: token ids, chosen logprobs and raw top-k logits bitwise equal (NaN = NaN)."""
    import numpy as np

    from tracekit.store import TraceReader

    with TraceReader(a) as ra, TraceReader(b) as rb:
        ka = {str(k): i for i, k in enumerate(ra.requests.key)}
        kb = {str(k): i for i, k in enumerate(rb.requests.key)}
        same, differ = 0, []
        for key, i in ka.items():
            ta, tb = ra.tokens(i), rb.tokens(kb[key]) if key in kb else None
            eq = tb is not None and all(
                x is not None and y is not None and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
                for x, y in (
                    (ta.token_id, tb.token_id),
                    (ta.logprob, tb.logprob),
                    (ta.topk_logit, tb.topk_logit),
                    (ta.topk_id, tb.topk_id),
                )
            )
            same += eq
            if not eq:
                differ.append(key)
    return {"requests": len(ka), "bitwise_equal": same, "differing_keys": differ}


def serve_repro(model: str, prompts: str, out: Path, device: str = "cuda", dtype: str = "bf16") -> dict:
    """The same serial capture on two fresh `tracekit serve` processes, compared bitwise."""
    from tracekit.capture.http import CaptureConfig, run_capture
    from tracekit.engine.process import start_engine

    out.mkdir(parents=True, exist_ok=True)
    args = ["--model", model, "--dtype", dtype, "--device", device, "--slots", "4", "--max-context", "9216"]
    traces = []
    for run in (0, 1):
        trace = out / f"serial_{run}.h5"
        with start_engine(args, timeout_s=900, log_path=out / f"serve_{run}.log") as eng:
            cfg = CaptureConfig(
                url=eng.url, prompts=prompts, out=str(trace), concurrency=1, top_logprobs=20, progress=False
            )
            run_capture(cfg)
        traces.append(trace)
    return {"command": "tracekit serve " + " ".join(args), "prompts": prompts, **compare_traces(*traces)}


def copy_bandwidth(dev, n_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median)."""
    import torch

    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize(dev)
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    return 2 * n_bytes / statistics.median(times[2:])


def _device_ms(ex, slots, lengths, nxt, steps: int) -> float | None:
    """Kernel time per step from torch.profiler (sum of CUDA kernel durations); None on CPU
    or when the profiler's API does not give it (the wall time still stands)."""
    if ex.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k in range(steps):
                ex.decode(slots, [n + k for n in lengths], nxt)
            _sync(ex.device)
        total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    except (AttributeError, RuntimeError, AssertionError) as e:
        print(f"device time not measured: {e}", flush=True)
        return None
    return total_us / 1e3 / steps


def decode_speed(ex, prompts: list[list[int]], steps: int = 16) -> dict:
    """One batched decode step of len(prompts) rows: wall and device time vs the bandwidth floor."""
    from tracekit.engine.memory import memory_report

    b = len(prompts)
    for s, p in enumerate(prompts):
        ex.prefill(s, p, 0)
    slots, lengths, nxt = list(range(b)), [len(p) for p in prompts], [1] * b
    for k in range(3):  # warm-up (the batch buffer is built on the first)
        ex.decode(slots, [n + k for n in lengths], nxt)
    lengths = [n + 3 for n in lengths]
    walls = []
    for k in range(steps):
        _sync(ex.device)
        t0 = time.perf_counter()
        ex.decode(slots, [n + k for n in lengths], nxt)
        _sync(ex.device)
        walls.append(time.perf_counter() - t0)
    lengths = [n + steps for n in lengths]
    device_ms = _device_ms(ex, slots, lengths, nxt, 4)
    mem = memory_report(ex)
    kv_token = mem["kv_bytes_per_slot"] // ex.max_context  # bytes of K and V of one position
    kv_read = sum(lengths) * kv_token
    bw = copy_bandwidth(ex.device) if ex.device.type == "cuda" else None
    floor_ms = (mem["weights_bytes"] + kv_read) / 4.8e12 * 1e3
    floor_meas_ms = None if bw is None else (mem["weights_bytes"] + kv_read) / bw * 1e3
    wall_ms = statistics.median(walls) * 1e3
    return {
        "rows": b,
        "context_tokens_per_row": lengths,
        "weights_bytes": mem["weights_bytes"],
        "kv_bytes_read": kv_read,
        "copy_bandwidth_bytes_per_s": None if bw is None else round(bw),
        "floor_ms_4p8tbs": round(floor_ms, 3),
        "floor_ms_measured_bw": None if floor_meas_ms is None else round(floor_meas_ms, 3),
        "step_wall_ms_median": round(wall_ms, 3),
        "step_device_ms": None if device_ms is None else round(device_ms, 3),
        "wall_over_floor": round(wall_ms / floor_ms, 2),
        "device_over_floor": None if device_ms is None else round(device_ms / floor_ms, 2),
        "step_wall_ms_all": [round(w * 1e3, 2) for w in walls],
    }


def main_checks(models_dir: Path, prompts_2048: Path, device: str, small: bool = False) -> dict:
    """Reproducibility (0.6B) and decode speed (4B, 8 rows): the JSON document of this phase."""
    import torch

    from tracekit.engine.executor import ModelExecutor

    rows = [json.loads(x)["prompt"] for x in prompts_2048.read_text().splitlines() if x.strip()]
    doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if device == "cuda" else None}
    ex = ModelExecutor(models_dir / "qwen3-0.6b", "bf16", "sdpa", device, slots=4, max_context=2048 + 80)
    doc["chain_repro_b4"] = chain_repro(ex, [r[:1000] for r in rows[:4]], steps=8 if small else 32)
    doc["chain_repro_b1"] = chain_repro(ex, [rows[0][:1000]], steps=8 if small else 32)
    del ex
    name = "qwen3-4b"
    ex = ModelExecutor(models_dir / name, "bf16", "sdpa", device, slots=8, max_context=2048 + 80)
    doc["decode_speed"] = {"model": name, **(decode_speed(ex, rows[:8], 4) if small else decode_speed(ex, rows[:8]))}
    del ex
    if device == "cuda":
        torch.cuda.empty_cache()
    return doc
