"""How far does a batched BF16 decode step move the logits, at this shape? The 4B pair's numbers in context.

    PYTHONPATH=. python bench/gpu_study/pair_probe.py --out /tmp/probe --models-dir /tmp/tkm --device cuda
    python bench/gpu_study/pair_probe.py --smoke --out /tmp/probesmoke   # CPU, the tiny fixture model

The reference engine's executor (Qwen3-4B config, RANDOM weights, BF16) on study_128's 16 prompts:
  serial     each prompt alone: prefill, then K greedy decode steps (its tokens are the script)
  b4, b8     the same tokens teacher-forced through batched decode steps, 4 or 8 rows of equal
             length (no padding: flash attention, no mask)
  b8-padded  each prompt as the longest row of a batch of 8 whose mates are 1..7 tokens shorter
             (padding: the masked attention path a burst with staggered admissions takes)
  fp32       the FP32 model on the whole sequence at once (the reference)
Per (config, prompt, position 0..K): the move of serial's top-2 gap (gap_cfg - gap_serial, nats),
whether the top-1 flips, and each side's error against FP32 (max |dlogit| over FP32's top 5).
Percentiles over every row and position, and where the watched pair s128-g1-p1 sits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PROMPTS = ROOT / "fixtures" / "prompts" / "study_128.jsonl"
TINY = ROOT / "fixtures" / "models" / "tiny"
WATCH = "s128-g1-p1"


def _q(x, qs=(50, 90, 99, 100)):
    import numpy as np

    x = np.asarray(x, dtype=float)
    return {f"p{q}": round(float(np.percentile(x, q)), 4) for q in qs} | {"n": int(x.size)}


def run(ex, ex32, rows: list[dict], K: int) -> dict:
    import torch

    ids = [r["prompt"] for r in rows]
    keys = [r["id"] for r in rows]
    n = len(ids)
    serial, toks = [], []
    for p in ids:  # alone: prefill then K greedy steps, slot 0
        ex.drop_batch()
        lg = [ex.prefill(0, p, 0).float()[0]]
        t = [int(lg[0].argmax())]
        for k in range(K):
            lg.append(ex.decode([0], [len(p) + k], [t[-1]]).float()[0])
            t.append(int(lg[-1].argmax()))
        serial.append(torch.stack(lg))
        toks.append(t)
    ref = []
    with torch.inference_mode():
        for p, t in zip(ids, toks):
            x = torch.tensor([p + t[:K]], device=ex32.device)
            out = ex32.model(input_ids=x).logits[0, len(p) - 1 :].float()  # positions 0..K
            ref.append(out)

    def batched(rows_ids: list[list[int]], target_rows: list[int], script: list[list[int]]):
        """Prefill rows into slots 0.., then K decode steps feeding `script` tokens; logits of the targets."""
        ex.drop_batch()
        first = [ex.prefill(s, p, 0).float()[0] for s, p in enumerate(rows_ids)]
        lg = {r: [first[r]] for r in target_rows}
        slots, lengths = list(range(len(rows_ids))), [len(p) for p in rows_ids]
        for k in range(K):
            out = ex.decode(slots, lengths, [script[s][k] for s in slots]).float()
            for r in target_rows:
                lg[r].append(out[r])
            lengths = [x + 1 for x in lengths]
        return {r: torch.stack(v) for r, v in lg.items()}

    cfgs: dict[str, list] = {"b4": [None] * n, "b8": [None] * n, "b8-padded": [None] * n}
    for size in (4, 8):
        for g in range(0, n, size):
            members = list(range(g, min(g + size, n)))
            got = batched([ids[i] for i in members], list(range(len(members))), [toks[i] for i in members])
            for j, i in enumerate(members):
                cfgs[f"b{size}"][i] = got[j]
    for i in range(n):  # target i full length at slot 0, 7 mates of its group 1..7 tokens shorter
        g = (i // 8) * 8
        mates = [j for j in range(g, min(g + 8, n)) if j != i][:7]
        rows_ids = [ids[i]] + [ids[j][: len(ids[j]) - 1 - m] for m, j in enumerate(mates)]
        script = [toks[i]] + [toks[j] for j in mates]
        cfgs["b8-padded"][i] = batched(rows_ids, [0], script)[0]

    def metrics(lg, i):
        s, r = serial[i], ref[i]
        top2 = s.topk(2, dim=-1).indices  # serial's top-2 at each position
        ar = torch.arange(s.shape[0])
        gap_s = s[ar, top2[:, 0]] - s[ar, top2[:, 1]]
        gap_c = lg[ar, top2[:, 0]] - lg[ar, top2[:, 1]]
        r5 = r.topk(5, dim=-1).indices
        err = lambda x: (x.gather(1, r5) - r.gather(1, r5)).abs().amax(1)  # noqa: E731
        return {
            "gap_serial": gap_s.tolist(),
            "dgap": (gap_c - gap_s).tolist(),
            # serial's top-1 no longer a maximum (exact ties are no flip: argmax and topk may order them apart)
            "flip": (lg[ar, top2[:, 0]] < lg.amax(-1)).tolist(),
            "err_serial": err(s).tolist(),
            "err_cfg": err(lg).tolist(),
            "gap_ref": (r[ar, top2[:, 0]] - r[ar, top2[:, 1]]).tolist(),
        }

    doc: dict = {"positions": K + 1, "configs": {}}
    for name, per in cfgs.items():
        m = [metrics(per[i], i) for i in range(n)]
        flat = lambda f: [abs(v) if f == "dgap" else v for mm in m for v in mm[f]]  # noqa: E731
        dg = flat("dgap")
        flips = sum(v for mm in m for v in mm["flip"])
        entry = {
            "abs_dgap_nats": _q(dg),
            "err_cfg_nats": _q(flat("err_cfg")),
            "err_serial_nats": _q(flat("err_serial")),
            "flips": int(flips),
            "flip_gaps_serial_nats": sorted(
                round(abs(mm["gap_serial"][k]), 4) for mm in m for k, f in enumerate(mm["flip"]) if f
            ),
        }
        if WATCH in keys:
            w = m[keys.index(WATCH)]
            entry["watch"] = {f: [round(float(v), 4) for v in w[f]] for f in w}
            v = abs(w["dgap"][1]) if len(w["dgap"]) > 1 else None
            if v is not None:
                entry["watch_pos1_abs_dgap_rank"] = f"{sum(x >= v for x in dg)} of {len(dg)} values >= {v:.4g}"
        doc["configs"][name] = entry
    doc["serial_err_nats"] = _q([v for i in range(n) for v in metrics(serial[i], i)["err_cfg"]])
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-dir", default="/tmp/tkm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    from tracekit.engine.executor import ModelExecutor

    t0 = time.perf_counter()
    if a.smoke:
        a.device, model, a.steps = "cpu", TINY, 3
    else:
        from bench.gpu_study.calibrated import model_dir

        model = model_dir(Path(a.models_dir), a.model, a.device)
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()]
    ex = ModelExecutor(model, "bf16", "sdpa", a.device, slots=8, max_context=256)
    ex32 = ModelExecutor(model, "fp32", "sdpa", a.device, slots=1, max_context=256)
    doc = {"model": "tiny fixture" if a.smoke else f"{a.model} shape, RANDOM weights (models.py)", "watch": WATCH}
    doc |= run(ex, ex32, rows, a.steps)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, e in doc["configs"].items():
        print(name, json.dumps({k: v for k, v in e.items() if k != "watch"}))
        if "watch" in e:
            print("  watch", json.dumps(e["watch"]))
    print("serial err", doc["serial_err_nats"], "seconds", doc["seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
