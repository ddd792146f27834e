"""The smallest KV-cache corruption `tracekit diff` flags, and how often it cries wolf.

Sensitivity: the reference engine's graded fault `--inject-fault perturb-kv:EPS`
serves every reused prefix-cache block as `kv * (1 + EPS * noise)` (a fixed
normal draw per element). For each EPS on a log grid: a serial capture on a
healthy engine and the same serial capture on a faulty one (same prompts, each
sent twice, so the second pass and prompts sharing a header hit the cache),
then `tracekit.analyze.compare.diff(healthy, faulty)`. A request is *affected* when, on
the faulty side, it reused cached blocks AND the fault changed at least one KV
value (the engine's GET /fault_log says how many: in BF16 a small EPS rounds
back to the same value). The figure is the share of affected requests that diff
calls `unexplained`; `detect_eps` is the smallest EPS of the grid from which on
that share is >= 95 %.

False alarms: on the healthy engine, `--runs` serial-vs-concurrent comparisons
(prefix cache emptied before each capture, concurrency varied), the share of all
pairs that diff calls `unexplained` (target 0).

Family: `--family` runs the fault-injection family instead (every kind of
tracekit/engine/faults.py SPECS at its default magnitude, BF16 and FP32, healthy vs
faulty captures, 20 healthy runs per dtype: 10 calibrate, 10 are the calibrated yardstick's
false-alarm runs); see bench/sensitivity_family.py. `--explain` adds `tracekit explain`'s
sensitivity and false alarms (bench/sensitivity_explain.py).

`--reference` (sweep): also judge every EPS on the calibrated + reference yardstick (the
calibration from half the false-alarm runs, the FP32 teacher-forced replay of the baseline);
the other half of the false-alarm runs are that yardstick's false alarms; `detect_eps_judged`.

Usage: python bench/sensitivity.py [--quick] [--json] [--dtype bf16|fp32] [--eps 1e-3,1e-2]
                                   [--runs 5] [--keep DIR]
       python bench/sensitivity.py --family [--quick] [--json] [--runs 20] [--family-dtypes bf16,fp32]
                                   [--explain [--explain-pairs 3] [--explain-healthy 10] [--explain-repeats 3]]
`--quick`: the 16 fixture prompts, 16 tokens, EPS 1e-3 .. 1, under 2 minutes on 2 cores (80 s).
`--family --quick`: the 16 fixture prompts, 8 tokens, 20 healthy runs per dtype; with `--explain`
3 changed pairs per kind and 10 healthy pairs per dtype explained, 3 repeats of each variant.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # sensitivity_family

from tracekit.analyze.compare import diff  # noqa: E402
from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402
from tracekit.engine.faults import prompt_ids_sha256  # noqa: E402
from tracekit.engine.process import start_engine  # noqa: E402
from tracekit.store import TraceReader  # noqa: E402

PROMPT_SETS = {"quick": ["tiny.jsonl"], "full": ["tiny.jsonl", "study_128.jsonl"]}
GRID = {"quick": (1e-3, 1e-2, 1e-1, 1.0), "full": (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)}
CONCURRENCY = (8, 16, 4, 8, 16, 4, 8, 16)  # of the false-alarm runs, in turn
DETECT_SHARE = 0.95


def log(msg: str) -> None:
    print(f"[sensitivity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_prompts(names: list[str], out: Path) -> Path:
    """The prompt sets, id and prompt only (length and EOS handling come from the capture)."""
    lines = []
    for name in names:
        for line in (ROOT / "fixtures" / "prompts" / name).read_text().splitlines():
            if line.strip():
                p = json.loads(line)
                lines.append(json.dumps({"id": p["id"], "prompt": p["prompt"]}))
    out.write_text("\n".join(lines) + "\n")
    return out


def http(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def capture(url: str, prompts: Path, out: Path, concurrency: int, args) -> Path:
    cfg = CaptureConfig(
        url=url,
        prompts=str(prompts),
        out=str(out),
        concurrency=concurrency,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        repeat=2,  # the second pass reuses the first pass's blocks
        progress=False,
    )
    s = run_capture(cfg)
    if s.failed:
        raise SystemExit(f"capture {out.name}: {s.failed} requests failed: {s.failures[:3]}")
    return out


def fault_applied(trace: Path, fault_log: dict) -> dict[str, tuple[int, int, int]]:
    """key -> (cached_tokens, KV values served from the cache, how many the fault changed),
    matching the serial capture's rows (in send order) with the engine's fault records (in
    admission order) by prompt ids."""
    pending = collections.defaultdict(collections.deque)
    for rec in fault_log["records"]:
        pending[rec["prompt_sha256"]].append(rec)
    out = {}
    with TraceReader(trace) as r:
        rows = sorted(range(len(r)), key=lambda i: r.record(i).t_sent_s)
        for i in rows:
            rec = r.record(i)
            total = changed = 0
            if rec.cached_tokens > 0:
                queue = pending[prompt_ids_sha256(r.prompt_ids(i).tolist())]
                if not queue:
                    raise SystemExit(f"{trace}: {rec.key} hit the cache but the engine logged no fault for it")
                fr = queue.popleft()
                assert fr["cached_tokens"] == rec.cached_tokens, (rec.key, fr)
                total, changed = fr["kv_values"], fr["kv_values_changed"]
            out[rec.key] = (rec.cached_tokens, total, changed)
    return out


def sweep_point(
    eps: float, base: Path, prompts: Path, work: Path, engine_args: list[str], args, yardstick: dict | None = None
) -> dict:
    """One EPS: faulty engine, serial capture, diff against the healthy baseline (plain, and
    with `yardstick` = the calibration and the FP32 reference when given)."""
    with start_engine([*engine_args, "--inject-fault", f"perturb-kv:{eps!r}"], timeout_s=300) as eng:
        trace = capture(eng.url, prompts, work / f"perturb_{eps:g}.h5", 1, args)
        applied = fault_applied(trace, http(eng.url + "/fault_log"))
    res = diff(base, trace)
    judged = _judged(diff(base, trace, **yardstick), applied) if yardstick else None
    by_cls: dict[str, collections.Counter] = {"affected": collections.Counter(), "other": collections.Counter()}
    drift = []  # affected pairs: max |Δ chosen logprob| before the first difference (nats)
    for p in res.pairs:
        cached, _, changed = applied.get(p.key, (0, 0, 0))
        hit = cached > 0 and changed > 0
        by_cls["affected" if hit else "other"][p.cls] += 1
        if hit and p.drift_max is not None:
            drift.append(p.drift_max)
    aff, oth = by_cls["affected"], by_cls["other"]
    n_aff = sum(aff.values())
    return {
        "eps": eps,
        "pairs": len(res),
        "hits": sum(1 for c, _, _ in applied.values() if c > 0),
        "affected": n_aff,
        "unexplained": aff["unexplained"],
        "share": aff["unexplained"] / n_aff if n_aff else None,
        "affected_classes": dict(aff),
        "unaffected_unexplained": oth["unexplained"],
        "kv_changed": _mean([ch / tot for c, tot, ch in applied.values() if c > 0]),
        "drift_p50": _quantile(drift, 0.5),
        "drift_max": max(drift, default=None),
        "judged": judged,
    }


def _judged(res, applied: dict) -> dict:
    """The sweep point on the calibrated + reference yardstick: a run that fails (a pair
    unexplained, or a run-level test of the calibration or the reference) flags all its
    affected requests; `pair_flagged` counts the affected pairs unexplained one at a time,
    `unaffected_flagged` the pairs the fault never touched that it calls unexplained (false
    alarms inside a faulty run)."""
    aff = [p for p in res.pairs if applied.get(p.key, (0, 0, 0))[0] > 0 and applied[p.key][2] > 0]
    keys = {p.key for p in aff}
    pair_flagged = sum(p.cls in ("unexplained", "incomparable") for p in aff)
    ref, ft = res.reference, res.flip_test
    return {
        "ok": res.ok,
        "affected": len(aff),
        "flagged": len(aff) if not res.ok else pair_flagged,
        "share": (len(aff) if not res.ok else pair_flagged) / len(aff) if aff else None,
        "pair_flagged": pair_flagged,
        "unaffected_flagged": sum(p.cls in ("unexplained", "incomparable") for p in res.pairs if p.key not in keys),
        "run_verdict": ref.run_verdict if ref is not None else None,
        "run_pairs": ref.run_pairs if ref is not None else None,
        "run_median_ratio": ref.run_median_ratio if ref is not None else None,
        "run_p_b": ref.run_p_b if ref is not None else None,
        "flip_p": ft.p_value if ft is not None else None,
    }


def _quantile(xs: list[float], q: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def false_alarms(url: str, prompts: Path, work: Path, args) -> list[dict]:
    """Serial vs concurrent on the healthy engine, cold cache before each capture."""
    runs = []
    for i in range(args.runs):
        c = CONCURRENCY[i % len(CONCURRENCY)]
        http(url + "/reset_prefix_cache", "POST")
        serial = capture(url, prompts, work / f"healthy_serial_{i}.h5", 1, args)
        http(url + "/reset_prefix_cache", "POST")
        conc = capture(url, prompts, work / f"healthy_c{c}_{i}.h5", c, args)
        res = diff(serial, conc)
        drift = [p.drift_max for p in res.pairs if p.drift_max is not None]
        runs.append(
            {"run": i, "concurrency": c, **res.counts(), "drift_max": max(drift, default=None), "trace": str(conc)}
        )
        counts = res.counts()
        log(f"false-alarm run {i} (c={c}): {counts}")
    return runs


def detect_eps(sweep: list[dict], judged: bool = False) -> float | None:
    """The smallest EPS > 0 from which on every grid point flags >= 95 % of its affected
    requests (plain diff, or with `judged` the calibrated + reference yardstick)."""
    best = None
    for row in sorted((r for r in sweep if r["eps"] > 0), key=lambda r: r["eps"], reverse=True):
        r = row["judged"] if judged else row
        if r is None or not r["affected"] or r["share"] < DETECT_SHARE:
            break
        best = row["eps"]
    return best


def held_out(base: Path, runs: list[dict], work: Path) -> tuple[dict, list[dict]]:
    """The calibrated + reference yardstick of the sweep (calibration from the first half of the
    healthy concurrent runs against the baseline, the FP32 teacher-forced replay of the
    baseline's tokens) and the other half judged on it (its false alarms)."""
    from sensitivity_family import _reference

    from tracekit.analyze.calibrate import measure

    half = max(1, len(runs) // 2)
    cal = measure([(str(base), r["trace"]) for r in runs[:half]], "sweep-healthy")
    yardstick = {"calibration": cal, "reference": _reference(base, work / "reference_fp32.h5")}
    out = []
    for r in runs[half:]:
        res = diff(base, r["trace"], **yardstick)
        ref = res.reference
        out.append(
            {
                "run": r["run"],
                "ok": res.ok,
                "flagged_pairs": sum(p.cls in ("unexplained", "incomparable") for p in res.pairs),
                "run_median_ratio": ref.run_median_ratio,
                "run_p_b": ref.run_p_b,
                "flip_p": res.flip_test.p_value,
            }
        )
        log(f"held-out healthy run {r['run']} on the calibrated yardstick: {'ok' if res.ok else 'FALSE ALARM'}")
    return yardstick, out


def table(sweep: list[dict], runs: list[dict], dtype: str) -> str:
    out = [
        f"perturb-kv sweep ({dtype}, serial healthy vs serial faulty):",
        "| EPS | hits | KV values changed | affected | unexplained / affected | share | affected verdicts "
        "| drift p50 / max (nats) | unexplained, unaffected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep:
        share = _pct(r["share"])
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted(r["affected_classes"].items())) or "-"
        out.append(
            f"| {r['eps']:g} | {r['hits']} | {_pct(r['kv_changed'])} | {r['affected']} "
            f"| {r['unexplained']}/{r['affected']} | {share} "
            f"| {verdicts} | {_num(r['drift_p50'])} / {_num(r['drift_max'])} | {r['unaffected_unexplained']} |"
        )
    if any(r.get("judged") for r in sweep):
        out += [
            "",
            f"perturb-kv sweep ({dtype}) on the calibrated + reference yardstick "
            "(a failed run flags all its affected requests):",
            "| EPS | affected | flagged / affected | share | pairs unexplained one at a time | run-level (reference) "
            "| run median B/A | run p (B farther) | flip-test p | unaffected pairs flagged |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sweep:
            j = r["judged"]
            out.append(
                f"| {r['eps']:g} | {j['affected']} | {j['flagged']}/{j['affected']} | {_pct(j['share'])} "
                f"| {j['pair_flagged']} | {j['run_verdict'] or 'consistent'} ({j['run_pairs']} pairs) "
                f"| {_num(j['run_median_ratio'])} | {_num(j['run_p_b'])} | {_num(j['flip_p'])} "
                f"| {j['unaffected_flagged']} |"
            )
    out += ["", f"false alarms ({dtype}, healthy serial vs concurrent):"]
    out += ["| run | concurrency | pairs | verdicts | drift max (nats) |", "|---|---|---|---|---|"]
    for r in runs:
        skip = ("run", "concurrency", "pairs", "drift_max", "trace")
        verdicts = ", ".join(f"{k} {v}" for k, v in r.items() if k not in skip and v)
        out.append(f"| {r['run']} | {r['concurrency']} | {r['pairs']} | {verdicts} | {_num(r['drift_max'])} |")
    return "\n".join(out)


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    ap.add_argument("--eps", default=None, help="comma-separated EPS grid (default: by mode)")
    ap.add_argument(
        "--runs", type=int, default=None, help="false-alarm runs (default 5; --family 20: half calibrate, half judged)"
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also judge the sweep on the calibrated + reference yardstick (calibration from half the "
        "false-alarm runs, the other half its false alarms; FP32 teacher-forced reference of the baseline)",
    )
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--keep", default=None, help="keep the traces in this directory")
    ap.add_argument("--family", action="store_true", help="the fault-injection family (sensitivity_family.py)")
    ap.add_argument("--family-dtypes", default="bf16,fp32")
    ap.add_argument("--family-kinds", default="", help="--family: only these kinds (comma-separated; default all)")
    ap.add_argument(
        "--explain",
        action="store_true",
        help="--family: also run `tracekit explain` (calibrated, teacher-forced reference) on changed pairs "
        "of each kind and on divergent pairs of the held-out healthy runs (sensitivity_explain.py)",
    )
    ap.add_argument("--explain-pairs", type=int, default=None, help="changed pairs explained per kind and dtype")
    ap.add_argument("--explain-healthy", type=int, default=None, help="healthy divergent pairs explained per dtype")
    ap.add_argument("--explain-repeats", type=int, default=None, help="runs of each explain variant")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    if args.family:
        return family_main(args, mode)
    args.runs = args.runs or 5
    grid = tuple(float(x) for x in args.eps.split(",")) if args.eps else GRID[mode]
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    engine_args = ["--threads", args.threads, "--dtype", args.dtype, "--slots", "8"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tracekit-sensitivity-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        prompts = write_prompts(PROMPT_SETS[mode], work / "prompts.jsonl")
        n_prompts = len(prompts.read_text().splitlines())
        with start_engine(engine_args, timeout_s=300) as eng:
            base = capture(eng.url, prompts, work / "healthy_serial.h5", 1, args)
            runs = false_alarms(eng.url, prompts, work, args)
        yardstick, judged_runs = held_out(base, runs, work) if args.reference else (None, [])
        sweep = []
        for eps in grid:
            sweep.append(sweep_point(eps, base, prompts, work, engine_args, args, yardstick))
            r, j = sweep[-1], sweep[-1]["judged"]
            msg = f"EPS {eps:g}: {r['unexplained']}/{r['affected']} affected flagged, {r['hits']} hits"
            if j:
                msg += f"; calibrated + reference {j['flagged']}/{j['affected']} ({j['run_verdict'] or 'consistent'})"
            log(msg)
    pairs = sum(r["pairs"] for r in runs)
    doc = {
        "dtype": args.dtype,
        "mode": mode,
        "prompts": n_prompts,
        "max_tokens": args.max_tokens,
        "detect_eps": detect_eps(sweep),
        "false_alarm_rate": sum(r["unexplained"] for r in runs) / pairs if pairs else None,
        "false_alarm_pairs": pairs,
        "detect_eps_judged": detect_eps(sweep, judged=True) if args.reference else None,
        "judged_held_out_runs": len(judged_runs),
        "judged_false_alarm_runs": sum(not r["ok"] for r in judged_runs),
        "judged_held_out": judged_runs,
        "calibration": yardstick["calibration"].describe() if yardstick else None,
        "sweep": sweep,
        "false_alarm_runs": runs,
        "classifier_commit": _last_commit("analyze/classify.py"),
        "analyze_dirty": _dirty("analyze"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(sweep, runs, args.dtype))
        if args.reference:
            print(
                f"\ncalibrated + reference ({doc['calibration']}): detect_eps_judged {doc['detect_eps_judged']}  "
                f"held-out healthy runs failed {doc['judged_false_alarm_runs']}/{doc['judged_held_out_runs']}"
            )
        print(f"\ndetect_eps {doc['detect_eps']}  false_alarm_rate {doc['false_alarm_rate']}  ({doc['wall_s']} s)")


def family_main(args, mode: str) -> None:
    import sensitivity_family as fam

    args.max_tokens = args.max_tokens or (8 if args.quick else 16)
    # half the healthy runs calibrate, the other half are the calibrated yardstick's false-alarm runs (10)
    args.runs = args.runs or 20
    args.explain_pairs = args.explain_pairs or (3 if args.quick else 8)
    args.explain_healthy = args.explain_healthy or (10 if args.quick else 20)
    args.explain_repeats = args.explain_repeats or (3 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="tracekit-family-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc = fam.main(args, write_prompts, capture, http, log, work, PROMPT_SETS[mode])
    doc["classifier_commit"] = _last_commit("analyze/classify.py")
    doc["analyze_dirty"] = _dirty("analyze")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(fam.table(doc))
        print(f"\n{doc['prompts']} prompts x2, {doc['max_tokens']} tokens, {doc['wall_s']} s")


def _dirty(path: str) -> bool | None:
    """Whether the checkout's `path` has uncommitted changes (the figures then come from them)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", path], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return None
    return bool(out.stdout.strip())


def _last_commit(path: str) -> str:
    try:
        return subprocess.run(
            ["git", "log", "-1", "--format=%h %s", "--", path], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
