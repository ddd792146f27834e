"""`bench/sensitivity.py --family`: which of the imitated engine bugs `tracekit diff` catches.

For each dtype (BF16, FP32): a healthy engine gives the serial baseline (each prompt sent
twice, so the second pass reuses cached blocks) and `--runs` (>= 10) healthy concurrent
captures, each diffed against the baseline: the false alarms (pairs diff calls `unexplained`
or `incomparable`). Then for each kind of the family (tracekit/engine/faults.py SPECS) at its
default magnitude, an engine with `--inject-fault KIND` runs the same serial capture and a
concurrent burst (cache emptied between them), and both are diffed against the healthy serial
baseline, as a user would.

A pair is *changed* when the faulty capture's request (token ids, chosen logprobs, top-k ids,
finish reason, reported cached_tokens) is bitwise none of the outputs the healthy engine gave
that request in any of its captures (the serial baseline and every healthy concurrent run): a
burst whose batch composition differs gives other BF16 numbers on a healthy engine too, and those
are not the fault's doing (a fault that happens to reproduce a healthy output is not counted).
The figure per kind: the share of changed pairs that diff flags. Today's classifier judges one pair at a time with fixed
tolerances, so many of these bugs pass as ties, post-EOS or boundary noise: these are the
numbers the calibration work has to raise.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np

from tracekit.analyze.compare import diff
from tracekit.engine.faults import SPECS
from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

FLAGGED = ("unexplained", "incomparable")
CONCURRENCY = 8
PREFILL_CHUNK = "16"  # chunk-boundary needs chunked prefill: one block per chunk


def family_kinds() -> list[str]:
    return [k for k, s in SPECS.items() if s.default is not None]


def outputs(trace: Path) -> dict[str, tuple]:
    """key -> what a fault can change, as bytes (compared bitwise)."""
    out = {}
    with TraceReader(trace) as r:
        for i in range(len(r)):
            rec, tok = r.record(i), r.tokens(i)
            out[rec.key] = (
                tok.token_id.tobytes(),
                np.nan_to_num(tok.logprob, nan=-9e9).tobytes(),
                tok.topk_id.tobytes(),
                rec.finish_reason,
                rec.cached_tokens,
            )
    return out


def _score(base: Path, faulty: Path, same_shape: dict[str, tuple]) -> dict:
    res = diff(base, faulty)
    got = outputs(faulty)
    changed = collections.Counter()
    for p in res.pairs:
        if got.get(p.key) not in same_shape.get(p.key, ()):
            changed[p.cls] += 1
    n = sum(changed.values())
    flagged = sum(changed[c] for c in FLAGGED)
    return {
        "pairs": len(res),
        "changed": n,
        "flagged": flagged,
        "share": flagged / n if n else None,
        "changed_classes": dict(changed),
        "flagged_all": sum(res.counts().get(c, 0) for c in FLAGGED),
    }


def run_dtype(dtype: str, prompts: Path, work: Path, args, capture, http, log) -> dict:
    engine_args = ["--threads", args.threads, "--dtype", dtype, "--slots", "8"]
    with start_engine(engine_args, timeout_s=300) as eng:
        base = capture(eng.url, prompts, work / f"{dtype}_healthy_serial.h5", 1, args)
        alarms, seen = [], collections.defaultdict(set)  # key -> every healthy output of it
        for key, out in outputs(base).items():
            seen[key].add(out)
        for i in range(args.runs):
            http(eng.url + "/reset_prefix_cache", "POST")
            conc = capture(eng.url, prompts, work / f"{dtype}_healthy_c{CONCURRENCY}_{i}.h5", CONCURRENCY, args)
            for key, out in outputs(conc).items():
                seen[key].add(out)
            counts = diff(base, conc).counts()
            alarms.append({"run": i, **counts})
            log(f"{dtype} healthy run {i}: {counts}")
    rows = []
    for kind in family_kinds():
        extra = ["--prefill-chunk", PREFILL_CHUNK] if SPECS[kind].needs == "prefill_chunk" else []
        with start_engine([*engine_args, *extra, "--inject-fault", kind], timeout_s=300) as eng:
            serial = capture(eng.url, prompts, work / f"{dtype}_{kind}_serial.h5", 1, args)
            http(eng.url + "/reset_prefix_cache", "POST")
            burst = capture(eng.url, prompts, work / f"{dtype}_{kind}_burst.h5", CONCURRENCY, args)
            applied = http(eng.url + "/fault_log").get("applied_total")
        row = {"kind": kind, "fault": f"{kind}:{SPECS[kind].default:g}", "applied": applied}
        row["serial"] = _score(base, serial, seen)
        row["burst"] = _score(base, burst, seen)
        rows.append(row)
        log(
            f"{dtype} {kind}: serial {row['serial']['flagged']}/{row['serial']['changed']}, "
            f"burst {row['burst']['flagged']}/{row['burst']['changed']} flagged/changed"
        )
    pairs = sum(a["pairs"] for a in alarms)
    false = sum(a.get(c, 0) for a in alarms for c in FLAGGED)
    return {
        "dtype": dtype,
        "kinds": rows,
        "false_alarm_runs": alarms,
        "false_alarms": false,
        "false_alarm_pairs": pairs,
    }


def table(doc: dict) -> str:
    out = [
        "| fault (default magnitude) | dtype | serial: flagged / changed | burst: flagged / changed "
        "| share flagged (both) | verdicts of the changed pairs | hook applications |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in doc["dtypes"]:
        for r in d["kinds"]:
            s, b = r["serial"], r["burst"]
            n, f = s["changed"] + b["changed"], s["flagged"] + b["flagged"]
            verdicts = collections.Counter(s["changed_classes"]) + collections.Counter(b["changed_classes"])
            v = ", ".join(f"{k} {c}" for k, c in sorted(verdicts.items())) or "-"
            share = f"{f / n:.0%}" if n else "n/a"
            out.append(
                f"| `{r['fault']}` | {d['dtype']} | {s['flagged']}/{s['changed']} | {b['flagged']}/{b['changed']} "
                f"| {share} | {v} | {r['applied']} |"
            )
    out += ["", "| dtype | healthy runs (serial vs concurrent) | pairs | flagged (false alarms) |", "|---|---|---|---|"]
    for d in doc["dtypes"]:
        out.append(f"| {d['dtype']} | {len(d['false_alarm_runs'])} | {d['false_alarm_pairs']} | {d['false_alarms']} |")
    return "\n".join(out)


def main(args, write_prompts, capture, http, log, work: Path, prompt_sets) -> dict:
    t0 = time.perf_counter()
    prompts = write_prompts(prompt_sets, work / "prompts.jsonl")
    dtypes = [x for x in args.family_dtypes.split(",") if x]
    doc = {"mode": "quick" if args.quick else "full", "prompts": len(prompts.read_text().splitlines())}
    doc["max_tokens"], doc["runs"] = args.max_tokens, args.runs
    doc["dtypes"] = [run_dtype(dt, prompts, work, args, capture, http, log) for dt in dtypes]
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    return doc
