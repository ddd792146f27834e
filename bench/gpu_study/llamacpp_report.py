"""The tables of bench/gpu_study/llamacpp_cuda.py: the cells (dtype from meta.ftype, speeds, the
verdicts plain / calibrated / calibrated + reference, serial repeat) and report.md."""

from __future__ import annotations

import json

from bench.gpu_study import calibrated as cal

WEIGHTS = "real architecture configs, RANDOM weights (seed 0, peaked LM head; bench/gpu_study/models.py)"


def cells_table(doc: dict) -> str:
    lines = [f"Models: {WEIGHTS}. Engine: llama.cpp `llama-server` ({doc['device']}), {doc['binary_version']}.", ""]
    lines += ["| cell | dtype (meta.ftype) | flags | serial / burst tok/s | plain | calibrated | cal + reference "]
    lines[-1] += "| serial1 vs serial2 |"
    lines += ["|---|---|---|---|---|---|---|---|"]
    for name, r in doc["cells"].items():
        if "error" in r:
            lines.append(f"| {name} | – | – | – | error: {r['error'][:120]} | | | |")
            continue
        d = r.get("dtype_recorded", {})
        ftype = f"{d.get('dtype')} ({r.get('meta', {}).get('ftype', '?')})"
        c = r["captures"]
        speed = f"{c['serial1']['tok_s']} / {c['burst1']['tok_s']}"
        vs = {v["mode"] + ("_ss" if v["b"].startswith("serial") else ""): v for v in r.get("verdicts", [])}

        def fmt(v):
            if v is None:
                return "–"
            counts = ", ".join(f"{k} {n}" for k, n in v["counts"].items() if k != "pairs")
            return f"{counts} (ok {v['ok']})"

        cells = [fmt(vs.get(m)) for m in ("plain", "cal", "cal+ref", "plain_ss")]
        lines.append(f"| {name} | {ftype} | `{r['flags']}` | {speed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(doc: dict) -> str:
    lines = [
        "# llama.cpp CUDA `llama-server` in the GPU study",
        "",
        f"**Models: {WEIGHTS}; not trained models.** Every table below is of these synthetic models.",
        f"Prompts {doc['prompts']} (16), {doc['max_tokens']} tokens, greedy, ignore_eos, top-20 logprobs, "
        f"cache_prompt {doc['cache_prompt']}. Per cell: serial1 and burst1 (concurrency = -np) are judged; "
        f"{doc['repeats']} more serial/burst pair(s) calibrate; the reference is the FP32 teacher-forced "
        "`full` replay of serial1 through HF transformers. The dtype column is what the capture recorded "
        "from `/v1/models` meta.ftype.",
        "",
        cells_table(doc),
        "Divergent pairs (calibrated + reference):",
        "",
        "| cell | key | class | pos | gap A ulp / nats | gap B ulp / nats | ref B/A [95% CI] (n, err A / B) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["cells"].items():
        for v in r.get("verdicts", []):
            if v["mode"] != "cal+ref":
                continue
            for p in v["pairs"]:
                if p["class"] == "identical":
                    continue
                lines.append(
                    f"| {name} | {p['key']} | {p['class']} | {cal._cell(p['position'])} | {cal._cell(p['gap_a_ulp'])}"
                    f" / {cal._cell(p['gap_a_nats'])} | {cal._cell(p['gap_b_ulp'])} / {cal._cell(p['gap_b_nats'])} "
                    f"| {cal.ref_cell(p)} | {p.get('ref_verdict', '–')} |"
                )
    lines += ["", "Calibrations:", ""]
    lines += [f"- {n}: {r['calibration']['line']}" for n, r in doc["cells"].items() if "calibration" in r]
    lines += ["", f"Phase times (s): {json.dumps(doc['seconds'])}", f"Command: `{doc['command']}`", ""]
    return "\n".join(lines)
