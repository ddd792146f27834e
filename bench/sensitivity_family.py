"""`bench/sensitivity.py --family`: which of the imitated engine bugs `tracekit diff` catches.

For each dtype (BF16, FP32): a healthy engine gives the serial baseline (each prompt sent
twice, so the second pass reuses cached blocks) and `--runs` (20) healthy concurrent
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
The figure per kind: the share of changed pairs that diff flags, judged two ways:

- `plain`: `tracekit diff base faulty` as before (one pair at a time, the documented defaults);
- `calibrated`: `tracekit diff base faulty --calibration CAL --reference REF`, where CAL is
  measured from the first half of the healthy concurrent runs (`tracekit calibrate`) and REF is
  the FP32 teacher-forced `full` replay of the baseline's tokens (HF, the fixture model). A
  capture is *flagged* when the diff fails (a pair unexplained/incomparable, or a run-level test
  of the calibration or the reference); its changed pairs then count as flagged. The false
  alarms of this yardstick: the second half of the healthy runs (10), each diffed the same way.
  Each capture also keeps the run-level numbers (`yardstick_stats`: both sides' error against
  the reference, the median excess, Wilcoxon p, observed vs expected flips).

With `--explain` (sensitivity_explain.py), `tracekit explain` with that calibration and the
teacher-forced reference runs on a few changed pairs of each kind, on the faulty engine, and on
divergent pairs of the held-out healthy runs, on the healthy engine.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import sensitivity_explain as xp

from tracekit.analyze.calibrate import measure
from tracekit.analyze.compare import diff
from tracekit.calibration import write_calibration
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


def _score(base: Path, faulty: Path, same_shape: dict[str, tuple], yardstick: dict) -> dict:
    res = diff(base, faulty)
    cal = diff(base, faulty, **yardstick)
    got = outputs(faulty)
    changed = collections.Counter()
    for p in res.pairs:
        if got.get(p.key) not in same_shape.get(p.key, ()):
            changed[p.cls] += 1
    n = sum(changed.values())
    flagged = sum(changed[c] for c in FLAGGED)
    changed_keys = {p.key for p in res.pairs if got.get(p.key) not in same_shape.get(p.key, ())}
    cal_flagged = n if not cal.ok else sum(1 for p in cal.pairs if p.key in changed_keys and p.cls in FLAGGED)
    return {
        "pairs": len(res),
        "changed": n,
        "flagged": flagged,
        "share": flagged / n if n else None,
        "changed_classes": dict(changed),
        "flagged_all": sum(res.counts().get(c, 0) for c in FLAGGED),
        "calibrated_flagged": cal_flagged,
        "calibrated_run_failed": not cal.ok,
        "calibrated_why": [x for x in cal.notes if "NOT consistent" in x or "FARTHER" in x][:2],
        "yardstick": yardstick_stats(cal),
    }


def _med(x) -> float | None:
    return float(np.median(x)) if len(x) else None


def yardstick_stats(res) -> dict:
    """The run-level numbers of a calibrated + reference diff: each side's error against the
    reference (medians over the pairs whose sides differ), the median per-pair excess B - A, the
    Wilcoxon result, and the flip test's observed vs expected flips."""
    ref, ft = res.reference, res.flip_test
    ok = np.isfinite(ref.ratio) & (ref.err_a != ref.err_b)
    return {
        "pairs_differ": int(ok.sum()),
        "err_a": _med(ref.err_a[ok]),
        "err_b": _med(ref.err_b[ok]),
        "excess": _med(ref.err_b[ok] - ref.err_a[ok]),
        "median_ratio": float(ref.run_median_ratio),
        "p_b": float(ref.run_p_b),
        "run_verdict": ref.run_verdict,
        "flips": ft.observed,
        "flips_expected": round(ft.expected, 3),
        "flip_p": ft.p_value,
    }


def rescore_diffs(doc: dict, work: Path) -> dict:
    """A `--family --json --keep WORK` document with every diff figure judged again by the current
    analysis code from WORK's kept traces (nothing re-sent; `rediffed: true`): the held-out healthy
    runs and each kind's serial and burst capture, on the kept calibration and reference."""
    from tracekit.calibration import read_calibration

    for d in doc["dtypes"]:
        dt = d["dtype"]
        base = work / f"{dt}_healthy_serial.h5"
        healthy = sorted(work.glob(f"{dt}_healthy_c{CONCURRENCY}_*.h5"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        seen = collections.defaultdict(set)
        for t in [base, *healthy]:
            for key, out in outputs(t).items():
                seen[key].add(out)
        yardstick = {"calibration": read_calibration(work / f"{dt}_calibration.json"),
                     "reference": work / f"{dt}_reference_fp32.h5"}  # fmt: skip
        half = max(1, len(healthy) // 2)
        held = []
        for t in healthy[half:]:
            r = diff(base, t, **yardstick)
            held.append({"run": int(t.stem.rsplit("_", 1)[1]), "ok": r.ok, "pairs": len(r), **yardstick_stats(r)})
        d["calibrated_held_out"] = held
        d["calibrated_false_alarm_runs"] = sum(not h["ok"] for h in held)
        d["calibrated_healthy_runs"] = len(held)
        for row in d["kinds"]:
            name = row["fault"].replace(":", "_")
            if not (work / f"{dt}_{name}_serial.h5").exists():
                name = row["kind"]
            for cap in ("serial", "burst"):
                row[cap] = _score(base, work / f"{dt}_{name}_{cap}.h5", seen, yardstick)
    doc["rediffed"] = True
    return doc


def _reference(base: Path, out: Path) -> Path:
    """The FP32 teacher-forced full replay of the baseline's tokens (the fixture model)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "tracekit", "capture", "--teacher-forced", str(root / "fixtures/models/tiny")]
    cmd += ["--from", str(base), "--history", "full", "--dtype", "fp32", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=root)
    return out


def run_dtype(dtype: str, prompts: Path, work: Path, args, capture, http, log) -> dict:
    engine_args = ["--threads", args.threads, "--dtype", dtype, "--slots", "8"]
    explain = getattr(args, "explain", False)
    healthy_explained: list[dict] = []
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
            alarms.append({"run": i, **counts, "trace": conc})
            log(f"{dtype} healthy run {i}: {counts}")
        half = max(1, len(alarms) // 2)
        ref = _reference(base, work / f"{dtype}_reference_fp32.h5")
        # with the reference: each healthy side's error against it sets the "both far" ceiling
        cal = measure(
            [(str(base), str(a["trace"])) for a in alarms[:half]], f"{dtype}-healthy-c{CONCURRENCY}", reference=ref
        )
        cal_path = write_calibration(cal, work / f"{dtype}_calibration.json")
        yardstick = {"calibration": cal, "reference": ref}
        held_out = []
        for a in alarms[half:]:
            r = diff(base, a["trace"], **yardstick)
            why = [x for x in r.notes if "NOT" in x or "FARTHER" in x]
            held_out.append({"run": a["run"], "ok": r.ok, "pairs": len(r), "why": why, **yardstick_stats(r)})
            log(f"{dtype} healthy run {a['run']} on the calibrated yardstick: {'ok' if r.ok else 'FALSE ALARM'}")
        if explain:  # explain's false alarms: divergent pairs of the held-out healthy runs, on the healthy engine
            for a in alarms[half:]:
                keys = xp.divergent(diff(base, a["trace"]))[: args.explain_healthy - len(healthy_explained)]
                if not keys:
                    continue
                root = work / f"{dtype}_explain_healthy_{a['run']}"
                got = xp.explain_pairs(base, a["trace"], eng.url, keys, cal_path, root, args, dtype)
                healthy_explained += [g | {"run": a["run"]} for g in got]
                log(f"{dtype} healthy run {a['run']}: explain {[g['kind'] for g in got]}")
                if len(healthy_explained) >= args.explain_healthy:
                    break
    divergent_healthy = sum(len(xp.divergent(diff(base, a["trace"]))) for a in alarms[half:]) if explain else None
    for a in alarms:
        a["trace"] = str(a["trace"])
    rows = []
    only = [k for k in getattr(args, "family_kinds", "").split(",") if k]
    for fault in only or family_kinds():  # KIND or KIND:MAGNITUDE (--family-kinds batch-scale:0.01)
        kind = fault.split(":")[0]
        fault = fault if ":" in fault else f"{kind}:{SPECS[kind].default:g}"
        name = fault.replace(":", "_") if only else kind  # the default magnitudes keep their file names
        extra = ["--prefill-chunk", PREFILL_CHUNK] if SPECS[kind].needs == "prefill_chunk" else []
        with start_engine([*engine_args, *extra, "--inject-fault", fault], timeout_s=300) as eng:
            serial = capture(eng.url, prompts, work / f"{dtype}_{name}_serial.h5", 1, args)
            http(eng.url + "/reset_prefix_cache", "POST")
            burst = capture(eng.url, prompts, work / f"{dtype}_{name}_burst.h5", CONCURRENCY, args)
            applied = http(eng.url + "/fault_log").get("applied_total")
            if explain:
                caps = {"serial": serial, "burst": burst}
                ex = _explain_kind(name, dtype, base, caps, seen, eng.url, cal_path, work, args)
        row = {"kind": kind, "fault": fault, "applied": applied}
        row["serial"] = _score(base, serial, seen, yardstick)
        row["burst"] = _score(base, burst, seen, yardstick)
        if explain:
            row["explain"] = ex
        rows.append(row)
        log(
            f"{dtype} {kind}: serial {row['serial']['flagged']}/{row['serial']['changed']}, "
            f"burst {row['burst']['flagged']}/{row['burst']['changed']} flagged/changed"
            + (f"; explain {ex['flagged']}/{ex['explained']} flagged {ex['kinds']}" if explain else "")
        )
    pairs = sum(a["pairs"] for a in alarms)
    false = sum(a.get(c, 0) for a in alarms for c in FLAGGED)
    return {
        "dtype": dtype,
        "kinds": rows,
        "false_alarm_runs": alarms,
        "false_alarms": false,
        "false_alarm_pairs": pairs,
        "calibration": cal.describe(),
        "calibrated_false_alarm_runs": sum(not h["ok"] for h in held_out),
        "calibrated_healthy_runs": len(held_out),
        "calibrated_held_out": held_out,
        "explain_healthy": xp.tally(healthy_explained) | {"divergent": divergent_healthy} if explain else None,
    }


def _explain_kind(kind: str, dtype: str, base: Path, captures: dict, seen, url: str, cal_path: Path, work: Path, args):
    """`tracekit explain` on up to args.explain_pairs changed pairs with a differing token, on the
    faulty engine (still running): one explain run, on the capture (serial or burst) with more
    such pairs (the burst on a tie), to keep the bench affordable."""
    changed_div, changed = {}, 0
    for name, trace in captures.items():
        got = outputs(trace)
        ch = {k for k, o in got.items() if o not in seen.get(k, ())}
        changed += len(ch)
        changed_div[name] = xp.divergent(diff(base, trace), ch)
    name = max(changed_div, key=lambda k: (len(changed_div[k]), k == "burst"))
    keys = changed_div[name][: args.explain_pairs]
    got = xp.explain_pairs(base, captures[name], url, keys, cal_path, work / f"{dtype}_{kind}_explain", args, dtype)
    out = xp.tally([r | {"capture": name} for r in got])
    return out | {"changed": changed, "changed_divergent": sum(len(v) for v in changed_div.values()), "capture": name}


def table(doc: dict) -> str:
    explain = any(r.get("explain") for d in doc["dtypes"] for r in d["kinds"])
    xh = " explain: flagged / explained (kinds) | changed, no token to replay |" if explain else ""
    out = [
        "| fault (default magnitude) | dtype | serial: flagged / changed | burst: flagged / changed "
        "| share flagged (both) | calibrated + reference: flagged / changed | verdicts of the changed pairs "
        "| hook applications |" + xh,
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if explain else ""),
    ]
    for d in doc["dtypes"]:
        for r in d["kinds"]:
            s, b = r["serial"], r["burst"]
            n, f = s["changed"] + b["changed"], s["flagged"] + b["flagged"]
            verdicts = collections.Counter(s["changed_classes"]) + collections.Counter(b["changed_classes"])
            v = ", ".join(f"{k} {c}" for k, c in sorted(verdicts.items())) or "-"
            share = f"{f / n:.0%}" if n else "n/a"
            cf = s["calibrated_flagged"] + b["calibrated_flagged"]
            cshare = f"{cf}/{n} ({cf / n:.0%})" if n else "n/a"
            line = (
                f"| `{r['fault']}` | {d['dtype']} | {s['flagged']}/{s['changed']} | {b['flagged']}/{b['changed']} "
                f"| {share} | {cshare} | {v} | {r['applied']} |"
            )
            if explain:
                x = r["explain"]
                line += f" {_explained(x)} | {x['changed'] - x['changed_divergent']} |"
            out.append(line)
    out += [
        "",
        "| dtype | healthy runs (serial vs concurrent) | pairs | flagged (false alarms) "
        "| calibrated + reference: held-out healthy runs failed |"
        + (" explain on held-out healthy pairs |" if explain else ""),
        "|---|---|---|---|---|" + ("---|" if explain else ""),
    ]
    for d in doc["dtypes"]:
        line = (
            f"| {d['dtype']} | {len(d['false_alarm_runs'])} | {d['false_alarm_pairs']} | {d['false_alarms']} "
            f"| {d['calibrated_false_alarm_runs']}/{d['calibrated_healthy_runs']} ({d['calibration']}) |"
        )
        if explain:
            x = d["explain_healthy"]
            line += f" {_explained(x)} of {x['divergent']} divergent |"
        out.append(line)
    return "\n".join(out)


def _explained(x: dict) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(x["kinds"].items())) or "-"
    share = f" ({x['share']:.0%})" if x["share"] is not None else ""
    return f"{x['flagged']}/{x['explained']}{share} ({kinds})"


def main(args, write_prompts, capture, http, log, work: Path, prompt_sets) -> dict:
    t0 = time.perf_counter()
    prompts = write_prompts(prompt_sets, work / "prompts.jsonl")
    dtypes = [x for x in args.family_dtypes.split(",") if x]
    doc = {"mode": "quick" if args.quick else "full", "prompts": len(prompts.read_text().splitlines())}
    doc["max_tokens"], doc["runs"] = args.max_tokens, args.runs
    doc["dtypes"] = [run_dtype(dt, prompts, work, args, capture, http, log) for dt in dtypes]
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    return doc
