"""The diagnostic over several GPUs (`--device auto`: transformers' device_map) against one GPU.

Saves a random-weight Qwen3-0.6B-shaped model (bench/diagnostic_bench.py's
config) with save_pretrained, runs `tracekit capture --teacher-forced` on it
with `--device auto` and with `--device cuda` (4 prompts of 200 random
tokens, 16 greedy tokens, full,prefix:100,chunked:64,decode in BF16 and
FP32), and compares the two traces row by row: token ids and raw top-k
logits. Needs >= 2 GPUs and the accelerate package. Writes OUT/multi_gpu.json.

    OUT=/tmp/mg PYTHONPATH=. python bench/multi_gpu_check.py
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

OUT = os.environ.get("OUT", ".")
env = dict(os.environ)
res = {"gpus": torch.cuda.device_count()}
TMP = tempfile.mkdtemp(prefix="tracekit-mg-")  # model and prompts; traces go to OUT
try:
    import accelerate
except ImportError:
    sys.exit("error: --device auto needs the accelerate package (pip install accelerate)")
res["accelerate"] = accelerate.__version__
if res["gpus"] < 2:
    sys.exit("error: this check needs at least 2 visible GPUs")
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, ".")
from bench.diagnostic_bench import COMMON, CONFIGS

cfg = Qwen3Config(**CONFIGS["qwen3-0.6b"], **COMMON)
torch.manual_seed(0)
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained(f"{TMP}/q06")
del m
m = AutoModelForCausalLM.from_pretrained(f"{TMP}/q06", dtype=torch.bfloat16, device_map="auto")
res["hf_device_map_devices"] = {
    str(d): sum(1 for v in m.hf_device_map.values() if v == d) for d in set(m.hf_device_map.values())
}
del m
g = np.random.default_rng(0)
with open(f"{TMP}/p.jsonl", "w") as f:
    for i in range(4):
        f.write(json.dumps({"id": f"p{i}", "prompt": g.integers(2, 150000, 200).tolist()}) + "\n")
for dev in ("auto", "cuda"):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracekit",
            "capture",
            "--teacher-forced",
            f"{TMP}/q06",
            "--prompts",
            f"{TMP}/p.jsonl",
            "--max-tokens",
            "16",
            "--history",
            "full,prefix:100,chunked:64,decode",
            "--dtype",
            "bf16,fp32",
            "--device",
            dev,
            "--out",
            f"{OUT}/{dev}.h5",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    res[f"run_{dev}"] = {"rc": r.returncode, "stdout": r.stdout.strip()[-300:], "stderr": r.stderr.strip()[-400:]}
from tracekit.store import TraceReader

a, b = TraceReader(f"{OUT}/auto.h5"), TraceReader(f"{OUT}/cuda.h5")
ra, rb = a.requests, b.requests
cmp = {}
for i in range(len(ra.key)):
    k = (ra.key[i], ra.history[i], ra.dtype[i])
    j = [n for n in range(len(rb.key)) if (rb.key[n], rb.history[n], rb.dtype[n]) == k][0]
    ta, tb = a.tokens(i), b.tokens(j)
    cmp["%s %s %s" % k] = {
        "ids_equal": bool(np.array_equal(ta.token_id, tb.token_id)),
        "top_logit_bitwise": bool(np.array_equal(ta.topk_logit, tb.topk_logit)),
        "max_abs": float(np.abs(ta.topk_logit.astype(np.float64) - tb.topk_logit).max())
        if np.array_equal(ta.token_id, tb.token_id)
        else None,
    }
res["rows"] = len(ra.key)
res["all_ids_equal"] = all(v["ids_equal"] for v in cmp.values())
res["all_bitwise"] = all(v["top_logit_bitwise"] for v in cmp.values())
res["not_bitwise"] = {k: v for k, v in cmp.items() if not v["top_logit_bitwise"]}
res["run_meta_auto"] = {k: a.meta.run.get(k) for k in ("device", "attn", "cuda_graphs")}
print(json.dumps(res, indent=1))
open(f"{OUT}/multi_gpu.json", "w").write(json.dumps(res, indent=1))
