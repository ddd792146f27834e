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
