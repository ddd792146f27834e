"""The teacher-forced diagnostic's `decode` history against the bandwidth floor: one decode chain, timed.

    PYTHONPATH=. python bench/gpu_study/diag_chain.py --out /tmp/dc --models-dir /tmp/tkm --device cuda
    python bench/gpu_study/diag_chain.py --smoke --out /tmp/dcsmoke   # CPU, tiny fixture, mode inline

Qwen3-4B config, RANDOM weights (models.py), BF16, sdpa. B rows of study_2048 (2,048 tokens) plus 32
teacher-forced tokens: the cache is prefilled with the prompt, then `capture/teacher/graphs.decode_chain`
runs the 32 single-token steps (graphs with holes, capture included: the diagnostic captures per
chain) and, for comparison, the same steps as plain eager forwards. Wall per step against the floor
(every weight byte + the batch's KV read once, at 4.8 TB/s). B = 1, 4, 8; two runs each.
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
P2048 = ROOT / "fixtures" / "prompts" / "study_2048.jsonl"


def _sync(dev: str) -> None:
    import torch

    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def one(lm, ids, start: int, mode: str) -> float:
    """Wall seconds of the decode steps start..n-1 of ids on a cache holding ids[:, :start]."""
    import torch

    from capture.teacher.graphs import decode_chain
    from tracekit.hfcompat import new_dynamic_cache

    with torch.inference_mode():
        cache = new_dynamic_cache(lm.model)
        lm.model(input_ids=ids[:, :start], use_cache=True, logits_to_keep=1, **{lm.cache_kw: cache})
        _sync(lm.device)
        t0 = time.perf_counter()
        if mode == "eager":
            for p in range(start, ids.shape[1]):
                lm.model(input_ids=ids[:, p : p + 1], use_cache=True, logits_to_keep=1, **{lm.cache_kw: cache})
        else:
            decode_chain(lm, ids, start, cache, mode=mode)
        _sync(lm.device)
        return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", default="/tmp/tkm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one more graphed chain of the largest size")
    ap.add_argument("--sizes", default=None, help="batch sizes, e.g. 8 (default 1,4,8; smoke 1,2)")
    a = ap.parse_args(argv)
    import torch

    from capture.teacher.model import load_model

    if a.smoke:
        a.device, model, prompt_len, steps, sizes = "cpu", TINY, 60, 4, (1, 2)
    else:
        from bench.gpu_study.calibrated import model_dir

        model, prompt_len, steps, sizes = model_dir(Path(a.models_dir), "qwen3-4b", a.device), 2016, 32, (1, 4, 8)
    if a.sizes:
        sizes = tuple(int(x) for x in a.sizes.split(","))
    lm = load_model(str(model), "bf16", a.device, attn="sdpa")
    rows = [json.loads(x)["prompt"] for x in P2048.read_text().splitlines() if x.strip()]
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    cfg = lm.model.config
    kv_tok = cfg.num_hidden_layers * cfg.num_key_value_heads * getattr(cfg, "head_dim", 64) * 2 * 2
    mode = "inline" if a.smoke else "graphs"
    res = []
    for b in sizes:
        # teacher-forced tokens: the prompt's own next ids (any valid ids do for timing)
        seqs = [r[: prompt_len + steps] for r in rows[:b]]
        ids = torch.tensor(seqs, device=a.device)
        kv = b * (prompt_len + steps // 2) * kv_tok
        floor_ms = (weights + kv) / 4.8e12 * 1e3
        for m in ("eager", mode):
            walls = [one(lm, ids, prompt_len, m) for _ in range(2)]
            per = [w / steps * 1e3 for w in walls]
            res.append(
                {
                    "rows": b,
                    "prompt": prompt_len,
                    "steps": steps,
                    "mode": m,
                    "step_ms_runs": [round(x, 3) for x in per],
                    "floor_ms": round(floor_ms, 3),
                    "over_floor": round(min(per) / floor_ms, 2),
                }
            )
            print(json.dumps(res[-1]), flush=True)
    doc = {"model": "tiny fixture" if a.smoke else "qwen3-4b shape, RANDOM weights", "weights_bytes": weights}
    doc["chains"] = res
    if a.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        one(lm, ids, prompt_len, mode)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        doc["profile_rows"] = b
        doc["profile_top_tottime"] = [ln for ln in buf.getvalue().splitlines() if ln.strip()][:45]
        print("\n".join(doc["profile_top_tottime"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_chain.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
