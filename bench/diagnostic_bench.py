"""Benchmark the teacher-forced cache-history diagnostic against plain forwards.

For each sequence length it times, side by side (interleaved, the minimum of
--repeats): a plain transformers forward of the batch (logits for the scored
positions only), each history alone, and the diagnostic running all its
histories at once (shared segments, then top-k scoring). It prints a table, or
with --json one JSON object whose `vs_independent_forwards` is

    diagnostic time for the histories / time of as many plain forwards

(the worst over the sequence lengths; per-length values are in `cells`), and
`vs_independent_forwards_cpu` the same ratio in this process's CPU seconds
(a loaded machine disturbs the wall minimum of a short forward less than that
of the 4x longer diagnostic; CPU seconds count only the work).
The diagnostic cuts a history's first segment from a longer sibling's where
the two were verified bitwise for that shape (capture/teacher/reuse.py; the
default cell: `decode`'s prefill from `full`): the untimed warm-up call does
that verification, at one extra forward per new shape, so the timed repeats
measure the cut (or the fallback, where the verdict was False).
Models have random weights built from hard-coded configs (no downloads):
`tiny` is the fixture model's shape, `qwen3-0.6b` / `qwen3-4b` the real
Qwen3 configs. MFU counts 2*params*tokens (decoder layers, plus the LM head
on the scored positions) plus causal attention 2*layers*heads*head_dim*S^2,
against 768 TFLOP/s (a large BF16 matmul on an H200); it is reported on CUDA only.

Runs from a checkout with nothing installed:
    PYTHONPATH=. python bench/diagnostic_bench.py --quick
    PYTHONPATH=. python bench/diagnostic_bench.py --device cuda --config qwen3-0.6b,qwen3-4b \\
        --seq-len 2048,8192 --dtype bf16 --json --out-json diag_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_study.models import CONFIGS as PUBLISHED  # noqa: E402
from tracekit.capture.teacher.chain import STATS as CHAIN_STATS  # noqa: E402
from tracekit.capture.teacher.diagnostic import DiagnosticConfig  # noqa: E402
from tracekit.capture.teacher.graphs import STATS as GRAPH_STATS  # noqa: E402
from tracekit.capture.teacher.history import parse_histories  # noqa: E402
from tracekit.capture.teacher.model import ATTNS, resolve_attn, wrap_model  # noqa: E402
from tracekit.capture.teacher.scoring import score  # noqa: E402
from tracekit.capture.teacher.trie import run_histories  # noqa: E402
from tracekit.dtypes import torch_dtype  # noqa: E402

PEAK_BF16_FLOPS = 768e12

# Real Qwen3 config values: the architecture fields of bench/gpu_study/models.py's published
# configs (one home); weights are random. COMMON holds the rest (the same values).
_ARCH = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
CONFIGS = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    **{name: {k: PUBLISHED[name][k] for k in _ARCH} for name in ("qwen3-0.6b", "qwen3-4b")},
}
COMMON = dict(max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, eos_token_id=0)


def build_model(name: str, dtype: str, device: str, attn: str, cuda_graphs: bool = True):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**CONFIGS[name], **COMMON)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 4B model in seconds, not minutes
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch_dtype(dtype), attn_implementation=resolve_attn(attn, device)
        )
    return wrap_model(
        model.to(device).eval(), dtype, device, cuda_graphs
    )  # .to: a no-op unless the context was ignored


def diagnostic_batch(seq_len: int) -> int:
    """Sequences per batch as the diagnostic plans them (DiagnosticConfig.batch_tokens inputs a forward)."""
    return max(1, DiagnosticConfig.batch_tokens // (seq_len - 1))


def flops(cfg, n_seq: int, n_inputs: int, n_scored: int, layer_params: int) -> float:
    """Model FLOPs of one pass over [n_seq, n_inputs] with n_scored logits per sequence."""
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n_inputs**2
    return n_seq * (2 * layer_params * n_inputs + 2 * cfg.hidden_size * cfg.vocab_size * n_scored + attn)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def bench_cell(lm, seq_len: int, batch: int, n_gen: int, hist_text: str, repeats: int, diagnose: bool = False) -> dict:
    """Time plain forwards, each history alone and the whole diagnostic for one length."""
    import torch

    p = seq_len - n_gen
    half, inputs = max(1, p // 2), seq_len - 1
    specs = parse_histories(hist_text.replace("HALF", str(half)))
    hists = [s.resolve(p, n_gen, half) for s in specs]
    gen = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(2, lm.vocab_size, (batch, seq_len), generator=gen).to(lm.device)
    x, targets = ids[:, :-1], ids[:, p:]

    def plain():
        with torch.inference_mode():
            lm.model(input_ids=x, logits_to_keep=n_gen)

    def diagnostic(hs):
        def run():
            logits = run_histories(lm, x, p - 1, hs)
            for h in hs:
                score(logits[h.label], targets, 20)

        return run

    variants = {"plain": plain, "diagnostic": diagnostic(hists)}
    variants.update({h.label: diagnostic([h]) for h in hists})
    decode = [h for h in hists if h.label == "decode"]
    if decode and lm.cuda_graphs and lm.device.startswith("cuda"):  # side by side: the same history, eager steps
        eager_lm = dataclasses.replace(lm, cuda_graphs=False)
        variants["decode:eager"] = lambda: score(run_histories(eager_lm, x, p - 1, decode)["decode"], targets, 20)
    for fn in variants.values():  # warm-up: kernels, allocator, lazy imports
        fn()
    times = {k: [] for k in variants}
    cpu_times = {k: [] for k in variants}
    for _ in range(repeats):  # interleaved, so drift and neighbours hit every variant alike
        for k, fn in variants.items():
            wall, cpu = _timed(fn, lm.device)
            times[k].append(wall)
            cpu_times[k].append(cpu)
    # min, not median: on a shared machine the fastest run is the least disturbed one
    t = {k: min(v) for k, v in times.items()}
    cpu_min = {k: min(v) for k, v in cpu_times.items()}
    tokens = batch * inputs
    cell = {
        "seq_len": seq_len,
        "batch": batch,
        "scored_per_seq": n_gen,
        "histories": [h.label for h in hists],
        "time_s": {k: round(v, 5) for k, v in t.items()},
        "time_s_all": {k: [round(x, 5) for x in v] for k, v in times.items()},
        "tokens_per_s": {k: round(tokens / t[k], 1) for k in t if k != "diagnostic"},
        "vs_independent_forwards": round(t["diagnostic"] / (len(hists) * t["plain"]), 4),
        # the same ratio in CPU seconds: on a loaded machine the wall minimum of a 0.2 s forward is
        # less disturbed than that of a 4x longer diagnostic; CPU seconds count only this process's work
        "cpu_s": {k: round(v, 5) for k, v in cpu_min.items()},
        "vs_independent_forwards_cpu": round(cpu_min["diagnostic"] / (len(hists) * cpu_min["plain"]), 4),
        "vs_histories_alone": round(t["diagnostic"] / sum(t[h.label] for h in hists), 4),
        "history_vs_plain_tokens_per_s": {
            k: round(t["plain"] / t[k], 4) for k in t if k not in ("plain", "diagnostic")
        },
    }
    if "decode:eager" in variants:  # the graphed chain must be the eager chain, bit for bit, and reproducible
        eager_lm = dataclasses.replace(lm, cuda_graphs=False)
        e1, e2, g1 = (run_histories(m, x, p - 1, decode)["decode"] for m in (eager_lm, eager_lm, lm))
        cell["decode_bitwise"] = {
            "eager_vs_eager": bool(torch.equal(e1, e2)),
            "graphs_vs_eager": bool(torch.equal(g1, e1)),
        }
        del e1, e2, g1
    if lm.device.startswith("cuda"):
        cfg = lm.model.config
        layer_params = sum(q.numel() for q in lm.model.model.layers.parameters())
        f = flops(cfg, batch, inputs, n_gen, layer_params)
        cell["mfu_bf16"] = {k: round(f / t[k] / PEAK_BF16_FLOPS, 4) for k in t if k != "diagnostic"}
    if diagnose:  # ~10-20 s a cell on an H200 (the profiler's trace dominates): opt-in
        cell["host_s"] = host_times(lm, x, p - 1, hists)
        cell["decode_profile"] = _guarded(profile_history, lm, x, p - 1, [h for h in hists if h.label == "decode"])
        cell["numerics"] = _guarded(numerics, lm, x, p - 1, hists)
    return cell


def _guarded(fn, *args) -> dict:
    """An extra measurement that fails records why instead of losing the timings."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        print(f"{fn.__name__}: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def host_times(lm, x, first_scored: int, hists) -> dict:
    """Per history without scoring: [seconds until run_histories returns (the
    host has queued every kernel; it reads nothing back), seconds until the
    device is done]. host ~ total means the history is host/launch-bound."""
    out = {}
    for h in hists:
        _sync(lm.device)
        t0 = time.perf_counter()
        run_histories(lm, x, first_scored, [h])
        host = time.perf_counter() - t0
        _sync(lm.device)
        out[h.label] = [round(host, 5), round(time.perf_counter() - t0, 5)]
    return out


def profile_history(lm, x, first_scored: int, hists) -> dict:
    """torch.profiler counts over one run of `hists` (the decode history):
    kernel launches and host<->device syncs, to tell launch overhead from syncs."""
    if not hists:
        return {}
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lm.device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        run_histories(lm, x, first_scored, hists)
        _sync(lm.device)
    count = {}
    for e in prof.events():
        for key, names in (
            ("launches", ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")),
            ("syncs", ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")),
            ("memcpy", ("cudaMemcpyAsync", "cudaMemcpy")),
        ):
            if e.name in names:
                count[key] = count.get(key, 0) + 1
    forwards = len(hists[0].ends)
    return {"forwards": forwards, **count, "launches_per_forward": round(count.get("launches", 0) / forwards, 1)}


def numerics(lm, x, first_scored: int, hists) -> dict:
    """BF16 agreement of each history with `full`, under the loaded attention
    and under transformers' own masked `sdpa`: max |logit difference|, the
    fraction of scored positions whose argmax agrees, and the logit scale."""

    model = lm.model
    loaded = model.config._attn_implementation
    runs = {loaded: run_histories(lm, x, first_scored, hists)}
    if loaded != "sdpa":
        try:  # the attention modules read config._attn_implementation at every forward
            model.config._attn_implementation = "sdpa"
            runs["sdpa"] = run_histories(lm, x, first_scored, hists)
        except Exception as e:  # noqa: BLE001 - a diagnostic extra must not lose the timings
            print(f"numerics: cannot switch to sdpa ({e})", file=sys.stderr)
        finally:
            model.config._attn_implementation = loaded
    ref = runs[loaded]["full"].float()
    out = {"logit_absmax": round(ref.abs().max().item(), 4)}
    for attn, res in runs.items():
        for h in hists:
            y = res[h.label].float()
            out[f"{attn}:{h.label}"] = {
                "max_abs_vs_full": round((y - ref).abs().max().item(), 5),
                "argmax_agree": round((y.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            }
            if attn != loaded:
                out[f"{attn}:{h.label}"]["max_abs_vs_" + loaded] = round(
                    (y - runs[loaded][h.label].float()).abs().max().item(), 5
                )
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: PYTHONPATH=. python bench/diagnostic_bench.py --quick --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--config", default=None, help=f"comma list of {', '.join(CONFIGS)} (default tiny)")
    ap.add_argument("--seq-len", default=None, help="comma list of sequence lengths (default 512; cuda 2048,8192)")
    ap.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default fp32 on cpu, bf16 on cuda)")
    ap.add_argument(
        "--attn",
        default="auto",
        choices=list(ATTNS),
        help="auto = sdpa_lower_right on cuda (flash for segments on a cache), sdpa on cpu",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per batch (default 8 on cpu; on cuda as the diagnostic batches them: "
        f"{DiagnosticConfig.batch_tokens} input tokens a forward, 16 x 2048 or 4 x 8192)",
    )
    ap.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode steps eagerly (default on cuda: graphs with eager attention, graphs.py)",
    )
    ap.add_argument("--gen", type=int, default=32, help="scored (generated) positions per sequence")
    ap.add_argument(
        "--histories",
        default="full,prefix:HALF,chunked:HALF,decode",
        help="history list; HALF = half the prompt length",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (the minimum is reported)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: on a shared machine, busy neighbours stall OpenMP barriers)",
    )
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also record per-history host time, a profile of decode (launches, syncs) and, on cuda, "
        "BF16 agreement with full under this attention and under transformers' sdpa",
    )
    ap.add_argument("--quick", action="store_true", help="small and fast (< 1 minute on CPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--out-json", default=None, help="also write the JSON object to this path")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import torch

    a = parse_args(argv)
    cuda = a.device.startswith("cuda")
    torch.set_num_threads(a.threads)
    configs = (a.config or "tiny").split(",")
    default_lens = ("2048" if a.quick else "2048,8192") if cuda else "512"
    seq_lens = [int(s) for s in (a.seq_len or default_lens).split(",")]
    dtype = a.dtype or ("bf16" if cuda else "fp32")
    batch = a.batch
    repeats = a.repeats or (3 if a.quick else 5)
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"error: unknown --config {', '.join(bad)}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": dtype,
        "attn": resolve_attn(a.attn, a.device),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": a.threads,
        "repeats": repeats,
        "cells": [],
    }
    for name in configs:
        t0 = time.perf_counter()
        lm = build_model(name, dtype, a.device, a.attn, cuda_graphs=not a.no_cuda_graphs)
        print(f"built {name} ({dtype}, {a.device}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for s in seq_lens:
            n = batch or (diagnostic_batch(s) if cuda else 8)
            cell = {"config": name, **bench_cell(lm, s, n, a.gen, a.histories, repeats, a.diagnose)}
            result["cells"].append(cell)
            if a.out_json:  # after every cell, so a run cut short still leaves its figures
                _summarise(result)
                Path(a.out_json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            print(f"{name} seq {s}: vs_independent_forwards {cell['vs_independent_forwards']}", file=sys.stderr)
        del lm
        if cuda:
            torch.cuda.empty_cache()
    _summarise(result)
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(result, sort_keys=True) if a.json else table(result))
    return 0


def _summarise(result: dict) -> None:
    cells = result["cells"]
    result["vs_independent_forwards"] = max(c["vs_independent_forwards"] for c in cells)
    result["vs_independent_forwards_cpu"] = max(c["vs_independent_forwards_cpu"] for c in cells)
    result["preallocated_chains"] = CHAIN_STATS["preallocated_chains"]
    result["tokens_per_s"] = {f"{c['config']}@{c['seq_len']}": c["tokens_per_s"] for c in cells}
    result["cuda_graphs"] = {k: (v if k != "fallbacks" else v[:5]) for k, v in GRAPH_STATS.items()}


def table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for c in result["cells"]:
        for k, tps in c["tokens_per_s"].items():
            mfu = c.get("mfu_bf16", {}).get(k)
            rows.append(
                [
                    c["config"],
                    c["seq_len"],
                    c["batch"],
                    k,
                    f"{c['time_s'][k] * 1e3:.1f}",
                    f"{tps:,.0f}",
                    "" if k == "plain" else f"{c['history_vs_plain_tokens_per_s'][k]:.3f}",
                    "" if mfu is None else f"{mfu:.1%}",
                ]
            )
        rows.append(
            [
                c["config"],
                c["seq_len"],
                c["batch"],
                "diagnostic (all)",
                f"{c['time_s']['diagnostic'] * 1e3:.1f}",
                "",
                f"vs {len(c['histories'])} plain: {c['vs_independent_forwards']:.3f}",
                "",
            ]
        )
    head = ["config", "seq", "batch", "variant", "ms", "tokens/s", "speed vs plain", "MFU"]
    return (
        tabulate(rows, head) + f"\n\n{result['device']}, {result['dtype']}, {result['attn']}: "
        f"vs_independent_forwards (worst) = {result['vs_independent_forwards']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
