"""`bench/sensitivity.py --family --explain`: which of the imitated engine bugs `tracekit explain` reports.

`tracekit explain A B --url URL --calibration CAL --teacher-forced MODEL` reruns each divergent
pair of A (the healthy serial baseline) and B (a capture) under controlled variants on the live
engine B ran on (alone cold, alone warm at each side's reused-prefix boundary, a burst with B's
batch mates), replays it teacher-forced (FP32 and the run's dtype, the reference its runs are
scored against) and names the cause: a benign one (nondeterminism, prefix reuse, batch
composition, cache history) or a finding (`bug`: "report as a bug"; `unresolved`: B's token in
every live run and A's in none, explain's exit code 1 too).

Here, per dtype and fault kind: up to `--explain-pairs` of the changed pairs that have a
differing token (explain replays a token; a changed pair with the same tokens, e.g. a misreported
logprob, has nothing to replay and is counted apart), from one capture (the serial or the burst,
whichever has more such pairs), explained on the faulty engine itself; and on the healthy engine,
up to `--explain-healthy` divergent pairs of the held-out healthy runs, taken run by run (their
false alarms: a healthy engine must never get `bug`). Every count says its n.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "fixtures" / "models" / "tiny"
FLAGGED_KINDS = ("bug", "unresolved")


def divergent(res, keys: set[str] | None = None) -> list[str]:
    """Keys of the diff's pairs with a differing token explain can replay (optionally among `keys`)."""
    out = []
    for p in res.pairs:
        if keys is not None and p.key not in keys:
            continue
        if p.cls == "incomparable" or p.position is None or p.token_a is None or p.token_b is None:
            continue
        out.append(p.key)
    return out


def explain_pairs(base: Path, b: Path, url: str, keys: list[str], cal_path: Path, root: Path, args, dtype: str):
    """Run `tracekit explain` (the workflow) on `keys` of (base, b): [(key, kind, diff class, cause)]."""
    from tracekit.workflows.explain import ExplainOptions, explain_files

    if not keys:
        return []
    dts = "fp32" if dtype == "fp32" else f"fp32,{dtype}"
    o = ExplainOptions(
        url=url,
        repeats=args.explain_repeats,
        model_dir=str(MODEL),
        dtypes=dts,
        timeout_s=120.0,
        calibration=str(cal_path),
    )
    r = explain_files(str(base), str(b), root, o, keys)
    return [{"key": p.key, "kind": p.kind, "class": p.klass, "loud": p.loud, "cause": p.cause} for p in r.pairs]


def tally(rows: list[dict]) -> dict:
    """Counts of one set of explained pairs: flagged = bug or unresolved."""
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    flagged = sum(r["kind"] in FLAGGED_KINDS for r in rows)
    return {
        "explained": len(rows),
        "flagged": flagged,
        "bug": kinds.get("bug", 0),
        "share": flagged / len(rows) if rows else None,
        "kinds": kinds,
        "pairs": rows,
    }


def rescore(root: Path, cal_path: Path) -> list[dict]:
    """The explain of one kept explain directory (explain.json, variants-*.h5, teacher.h5) judged
    again by the current analysis code (the same runs: nothing is sent)."""
    import json

    from tracekit.analyze.explain import explain, select_pairs
    from tracekit.calibration import read_calibration

    doc = json.loads((root / "explain.json").read_text())
    keys = [p["key"] for p in doc["pairs"]]
    pairs, skipped, _ = select_pairs(doc["a"], doc["b"], keys)
    mates = {p["key"]: p["batch_mates"] for p in doc["pairs"]}
    variants = [str(root / v) for v in doc["traces"]["variants"]]
    teacher = str(root / doc["traces"]["teacher_forced"]) if doc["traces"].get("teacher_forced") else None
    cal = read_calibration(cal_path)
    finding = None
    if (root / "reference.h5").exists():  # the run-level test, as the workflow ran it (workflows/explain.py)
        from tracekit.workflows.explain import ExplainOptions, run_level

        o = ExplainOptions(url="", reference=str(root / "reference.h5"))
        finding, _ = run_level(doc["a"], doc["b"], cal, root, o)
    r = explain(doc["a"], doc["b"], pairs, variants, teacher, mates, skipped, calibration=cal, run_finding=finding)
    return [{"key": p.key, "kind": p.kind, "class": p.klass, "loud": p.loud, "cause": p.cause} for p in r.pairs]


def rescore_doc(doc: dict, work: Path) -> dict:
    """A `sensitivity.py --family --explain --json --keep WORK` document with every explain tally
    judged again from WORK's kept explain runs (`rescored: true`)."""
    for d in doc["dtypes"]:
        dt, cal = d["dtype"], work / f"{d['dtype']}_calibration.json"
        for row in d["kinds"]:
            x, root = row.get("explain"), work / f"{dt}_{row['fault'].replace(':', '_')}_explain"
            root = root if root.exists() else work / f"{dt}_{row['kind']}_explain"  # default magnitudes
            if x and x["explained"]:
                keep = {k: x[k] for k in ("changed", "changed_divergent", "capture")}
                row["explain"] = tally([r | {"capture": x["capture"]} for r in rescore(root, cal)]) | keep
        h = d.get("explain_healthy")
        if h and h["explained"]:
            rows = []
            for run in sorted({p["run"] for p in h["pairs"]}):
                rows += [r | {"run": run} for r in rescore(work / f"{dt}_explain_healthy_{run}", cal)]
            d["explain_healthy"] = tally(rows) | {"divergent": h["divergent"]}
    doc["rescored"] = True
    return doc


def main() -> None:
    import argparse
    import json
    import sys

    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import sensitivity_family as fam

    ap = argparse.ArgumentParser(description="judge a kept `sensitivity.py --family --explain` run's explains again")
    ap.add_argument("doc", type=Path, help="its --json output")
    ap.add_argument("--keep", type=Path, required=True, help="its --keep directory")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--diffs", action="store_true", help="also judge every diff figure again (rescore_diffs)")
    args = ap.parse_args()
    doc = rescore_doc(json.loads(args.doc.read_text()), args.keep)
    if args.diffs:
        doc = fam.rescore_diffs(doc, args.keep)
    print(json.dumps(doc, indent=1, default=str) if args.json else fam.table(doc))


if __name__ == "__main__":
    main()
