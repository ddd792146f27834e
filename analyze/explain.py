"""`tracekit explain`, analysis side: the cause of each flip, named from the variant rows.

The capture side (`capture/explain/`) reran every divergent pair under
controlled variants and wrote each run as a trace row whose `params` JSON
carries `explain: {target, variant, role, repeat, config}`. Here each run of
the target is scored at the pair's first differing position t:

- `B` / `A`: it chose B's / A's token at t, after A's exact tokens before t;
- `early`: it already left A's tokens before t; `other`: a third token at t;
  `failed`: not ok, or shorter than t + 1.

A run that chose B's token is **numeric** when its chosen-token logprobs
before t stay within `drift_nats` of A's and, at t, A's and B's tokens are
both in its top-k within `drift_nats` of each other: a near-tie that tipped,
not a different computation. Only numeric runs reproduce a flip. With a
calibration of this engine (`tracekit calibrate`), `drift_nats` is measured:
twice the largest of its healthy drift and its largest healthy flip gap
(`numeric_bound`); without one, the documented default 0.5 nats (said).

With the FP32 teacher-forced `full` replay of the pair, each run's distribution
up to t is also scored against it (mean weighted |Δlogprob|, reference.py): a
burst-only reproduction is batch composition only when the bursts are as close
to the reference as the alone runs (within RATIO_MIN, or the dtype's floor), or,
with a calibration measured against a reference, within the largest error a
healthy side of this engine had against it (the H200 Qwen3-4B pair: bursts 0.501
nats from it, alone 0.040, healthy sides up to 0.501); otherwise the batched path
computes farther from the truth than the engine's noise allows: a bug, with the numbers.

The verdict (first rule that fires), with counts:

1. `nondeterminism`: one alone variant (fixed boundary, no batch mates) gave
   both tokens: the engine's own run-to-run nondeterminism.
2. `prefix_reuse`: alone at B's boundary gives B's token, alone at A's
   boundary never does (a boundary of 0 is the cold run).
3. `batch_composition`: the burst with B's batch mates gives B's token, alone
   at B's boundary never does.
4. `cache_history`: no live variant reproduces it, but a teacher-forced
   history other than `full` in B's dtype picks B's token where `full` picks A's.
5. `unresolved`: B's token in every live run, A's in none: A's own conditions
   were not replayed.
6. `bug`: not reproduced by any numeric variant. A pair whose class was benign
   lands here loudly.

With a calibration, a benign pair no sampled run tipped, at a flip this healthy engine's noise
covers, is `calibrated_noise` (explain_noise.py says when).

The run-level test: one pair at a time, a deterministic bug of the batched path looks exactly like
a healthy tie flip (a burst reproduces it, alone does not: rule 3). With a calibration, the
workflow judges A vs B as `diff --calibration --reference` does; when the run fails a run-level
test (its flips more frequent or at larger gaps than this engine's P(flip | gap), or B farther
from the FP32 reference across the run: explain_noise.run_finding), every pair the rules above
call benign is a `bug` ("batched-path error beyond this engine's noise across the run"), its own
rule's cause kept after the run's numbers. Likewise a pair whose reported numbers fail diff's
row checks (top-k out of order, the chosen token's logprob not its top-k entry, `cached_tokens`
beyond the prompt or off the block size: reported.py) is a `bug` whatever explains its flip.

Which side is right: the side whose token the FP32 `full`-history argmax picks
(teacher-forced), else the FP32 configuration's cold runs (the majority).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from tracekit.store import TraceReader
from tracekit.variants import BURST, Variant
from tracekit.verdicts import BENIGN as _BENIGN

from .explain_noise import numeric_bound, within_noise
from .explain_runs import (
    Scorer,
    VariantCount,
    alone_at,
    config_lines,
    engine_history,
    ran,
    ran_at,
    read_reference_rows,
    read_teacher,
    read_variants,
    right_side,
    side_variant,
    where,
)
from .grid import pair_grids
from .reference import FLOOR, RATIO_MIN

NOT_REPRODUCED = "not reproduced by any numeric variant — report as a bug"
MISREPORTED = "the engine's reported numbers fail diff's checks — report as a bug"
RUN_LEVEL = "batched-path error beyond this engine's noise across the run — report as a bug"
DEFAULT_DRIFT_NATS = 0.5  # uncalibrated: the documented default (docs/explain.md)


BENIGN = tuple(v.value for v in _BENIGN)  # tracekit/verdicts.py
OK_KINDS = ("nondeterminism", "prefix_reuse", "batch_composition", "cache_history", "calibrated_noise")


@dataclass(frozen=True)
class PairExplanation:
    key: str
    klass: str
    position: int
    token_a: int
    token_b: int
    boundary_a: int
    boundary_b: int
    mates: int
    kind: str  # one of OK_KINDS, "unresolved" or "bug"
    cause: str
    loud: bool
    right: str  # which side agrees with the FP32 reference, in words
    right_side: str | None  # "A" | "B" | "neither" | None (no FP32 reference)
    variants: tuple[VariantCount, ...]
    teacher: dict  # "history dtype" -> top-1 id at t
    evidence: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.kind in OK_KINDS and not self.loud

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "class": self.klass,
            "position": self.position,
            "token_a": self.token_a,
            "token_b": self.token_b,
            "boundary_a": self.boundary_a,
            "boundary_b": self.boundary_b,
            "batch_mates": self.mates,
            "kind": self.kind,
            "cause": self.cause,
            "loud": self.loud,
            "right": self.right,
            "right_side": self.right_side,
            "variants": [v.as_dict() for v in self.variants],
            "teacher": self.teacher,
            "evidence": list(self.evidence),
        }


def verdict(
    p: dict, counts: dict, teacher: dict[str, int], b_dtype: str, mates: int, healthy_err: float | None = None
) -> tuple[str, str]:
    """(kind, cause text) by the rules of the module docstring, for the `engine` config.
    healthy_err: the calibration's largest healthy side's error against the reference (None:
    uncalibrated, or measured without a reference)."""
    ba, bb = int(p["boundary_a"]), int(p["boundary_b"])
    eng = {v: c for (cfg, v), c in counts.items() if cfg == "engine"}
    alone = [c for v, c in eng.items() if Variant.parse(v).alone]
    for c in alone:
        if c.a and c.b:
            v = Variant.parse(c.variant)
            at = str(v.boundary) if v.kind == "warm" else str(v)
            return "nondeterminism", (
                f"cause: run-to-run nondeterminism — alone ({at}), B's token in {c.b}/{c.n} runs, A's in {c.a}/{c.n}"
            )
    vb, va = side_variant(counts, "engine", bb), side_variant(counts, "engine", ba)
    achieved = ran_at(vb, bb) and ran_at(va, ba)  # only runs that reused what was asked test prefix reuse
    if ba != bb and vb is not None and va is not None and vb.b_numeric and not va.b and achieved:
        return "prefix_reuse", (
            f"cause: prefix reuse — B's token in {vb.b_numeric}/{vb.n} alone at B's boundary {where(bb)}, "
            f"0/{va.n} at A's boundary {where(ba)}"
        )
    burst = eng.get(str(BURST))
    if burst is not None and burst.b_numeric and vb is not None and not vb.b:
        within = ""
        if burst.err is not None and vb.err is not None:
            floor = FLOOR.get(b_dtype, FLOOR["bf16"])
            farther = burst.err > RATIO_MIN * vb.err and burst.err - vb.err > floor
            if farther and healthy_err is not None and burst.err <= healthy_err:
                within = (
                    f"; farther from the FP32 reference than alone ({burst.err:.3g} vs {vb.err:.3g} nats) but "
                    f"within this engine's healthy error against it (up to {healthy_err:.3g} nats, calibrated)"
                )
            elif farther:
                return "bug", (
                    f"batched-path error beyond this engine's noise — B's token in {burst.b_numeric}/{burst.n} "
                    f"bursts, 0/{vb.n} alone, but the bursts are {burst.err:.3g} nats from the FP32 reference "
                    f"against {vb.err:.3g} alone ("
                    + (f"ratio {burst.err / vb.err:.3g} > {RATIO_MIN}" if vb.err > 0 else "alone, exactly on it")
                    + "): "
                    "the batched path computes farther from the truth — report as a bug"
                )
        return "batch_composition", (
            f"cause: batch composition — B's token in {burst.b_numeric}/{burst.n} bursts with its {mates} batch "
            f"mates from B, 0/{vb.n} alone {alone_at(vb, bb)}"
            + ("" if ran_at(burst, bb) else f"; the bursts reused {ran(burst)}")
            + (
                within
                or (
                    f"; as close to the FP32 reference as alone ({burst.err:.3g} vs {vb.err:.3g} nats)"
                    if burst.err is not None and vb.err is not None
                    else ""
                )
            )
        )
    live = ", ".join(f"{c.b_numeric}/{c.n} {c.variant}" for c in eng.values())
    at_b, at_a = teacher.get(engine_history(bb, b_dtype)), teacher.get(engine_history(ba, b_dtype))
    if ba != bb and at_b == p["token_b"] and at_a == p["token_a"]:
        return "cache_history", (
            f"cause: cache history — the engine's own teacher-forced replay gives B's token at B's boundary "
            f"{where(bb)} and A's at A's {where(ba)} (each boundary proven by the engine's report); "
            f"no live variant reproduced it ({live or 'none ran'})"
        )
    full = teacher.get(f"full {b_dtype}")
    hits = [
        h
        for h, tok in teacher.items()
        if h.endswith(f" {b_dtype}") and not h.startswith("full ") and not h.startswith("engine:")
    ]
    hits = [h for h in hits if teacher[h] == p["token_b"]]
    if full == p["token_a"] and hits:
        return "cache_history", (
            f"cause: cache history — teacher-forced {', '.join(hits)} picks B's token, full {b_dtype} A's; "
            f"no live variant reproduced it ({live or 'none ran'})"
        )
    runs = [c for c in eng.values()]
    if runs and all(c.a == 0 for c in runs) and sum(c.b_numeric for c in runs) == sum(c.n for c in runs):
        n = sum(c.n for c in runs)
        return "unresolved", (
            f"unresolved — B's token in all {n} live runs, A's in none: A's own conditions (its batch, its "
            "cache state) were not replayed"
        )
    extra = [
        f"B's token came back in {c.b}/{c.n} {c.variant} runs, but not numerically "
        f"(drift {c.worst[0]:.3g} nats before t, gap {c.worst[1]:.3g} nats at t)"
        for c in eng.values()
        if c.b > c.b_numeric and c.worst is not None
    ]
    early = [
        f"{c.early}/{c.n} {c.variant} runs left A's tokens before t (first at {c.first_early})"
        for c in eng.values()
        if c.early
    ]
    gaps = [g for c in eng.values() if Variant.parse(c.variant).alone for g in c.gaps]
    if gaps:
        lo, hi = min(gaps), max(gaps)
        span = f"{lo:.3g}" if lo == hi else f"{lo:.3g}-{hi:.3g}"
        near = ": a near-tie the live variants did not tip; more --repeats may" if hi <= 0.125 else ""
        extra.append(f"alone, A's and B's tokens are {span} nats apart at t{near}")
    tail = f" ({'; '.join(([live] if live else []) + extra + early)})"
    return "bug", NOT_REPRODUCED + tail


@dataclass(frozen=True)
class ExplainResult:
    a: str
    b: str
    pairs: tuple[PairExplanation, ...]
    skipped: tuple[str, ...]  # keys not explained, with the reason
    notes: tuple[str, ...]
    drift_nats: float

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.pairs)

    def counts(self) -> dict[str, int]:
        c = Counter(p.kind for p in self.pairs)
        return {k: c.get(k, 0) for k in (*OK_KINDS, "unresolved", "bug")} | {"loud": sum(p.loud for p in self.pairs)}

    def to_json(self) -> dict:
        return {
            "schema": "tracekit.explain/1",
            "a": self.a,
            "b": self.b,
            "summary": self.counts(),
            "drift_nats": self.drift_nats,
            "skipped": list(self.skipped),
            "notes": list(self.notes),
            "pairs": [p.as_dict() for p in self.pairs],
        }


def select_pairs(a: str, b: str, keys: list[str] | None = None, **diff_opts) -> tuple[list[dict], list[str], dict]:
    """(pairs to explain, skipped 'key: reason' lines, the diff document). Pairs are the
    divergent ones (a first differing position), or `keys` when given."""
    from .compare import diff

    res = diff(a, b, **diff_opts)
    doc = res.to_json()
    by_key = {p["key"]: p for p in doc["pairs"]}
    for k, why in zip(res.columns["key"].tolist(), res.columns["refuted_reported"].tolist()):
        if why and k in by_key:  # the engine's own report fails a check: said whatever the flip's cause
            by_key[k] = {**by_key[k], "misreported": why}
    chosen = keys if keys else [p["key"] for p in doc["pairs"] if p["class"] not in ("identical", "incomparable")]
    pairs, skipped = [], []
    for k in chosen:
        p = by_key.get(k)
        if p is None:
            skipped.append(f"{k}: not in A or B")
        elif p["class"] == "incomparable":
            skipped.append(f"{k}: incomparable ({p['rule']})")
        elif p["position"] is None or p["token_a"] is None or p["token_b"] is None:
            skipped.append(f"{k}: {p['class']}, no differing token to replay")
        else:  # unknown boundaries are null in the diff document, -1 here (as in a trace)
            pairs.append({**p, **{k: -1 if p[k] is None else int(p[k]) for k in ("boundary_a", "boundary_b")}})
    return pairs, skipped, doc


def explain(
    a: str,
    b: str,
    pairs: list[dict],
    variants: list[str],
    teacher: str | None = None,
    mates: dict[str, int] | None = None,
    skipped: list[str] = (),
    drift_nats: float | None = None,
    notes: list[str] = (),
    calibration=None,
    engine_replay: str | None = None,
    run_finding: str | None = None,
) -> ExplainResult:
    """Score the variant traces (and the teacher-forced trace) of `pairs` and name each cause.
    drift_nats: the numeric bound; None takes it from `calibration` (a tracekit.calibration
    record), else the documented default (both said in the notes). run_finding: the run-level
    finding of A vs B judged on the calibration (explain_noise.run_finding; None: the run passed
    or was not judged): every pair explained benign then becomes `bug` (RUN_LEVEL)."""
    notes = list(notes)
    if run_finding:
        notes.append(f"run-level: {run_finding}")
    if drift_nats is None and calibration is not None:
        drift_nats = numeric_bound(calibration)
        notes.append(f"numeric bound {drift_nats:.3g} nats, measured: calibration {calibration.describe()}")
    elif drift_nats is None:
        drift_nats = DEFAULT_DRIFT_NATS
        notes.append(
            f"numeric bound {drift_nats:g} nats: the documented default, uncalibrated (a deeper model's healthy "
            "noise can exceed it; pass --calibration)"
        )
    else:
        notes.append(f"numeric bound {drift_nats:g} nats (given)")
    gap_nats = None  # the A/B gap at t of a run that gave B's token: the healthy top-2 gap move
    if calibration is not None and calibration.gap_move_max is not None:
        gap_nats = calibration.gap_move_max[0]
        if gap_nats > drift_nats:
            notes.append(
                f"gap bound {gap_nats:.3g} nats at t: this engine's healthy top-2 gap move (p100 over "
                f"{calibration.gap_move.get('n', 0)} positions, calibration {calibration.name})"
            )
    with TraceReader(a) as ra, TraceReader(b) as rb:
        b_dtype = pair_grids(rb.meta.record).a.dtype  # B alone: its own grid
        rows = ra.requests.index_by_key()
        scorers = {}
        for p in pairs:
            cols = ra.tokens(rows[p["key"]])
            lps = cols.logprob.astype(np.float64)
            scorers[p["key"]] = Scorer(p, cols.token_id, lps, drift_nats, gap_nats=gap_nats)
    if teacher:
        refs = read_reference_rows(teacher, set(scorers))
        for key, (ids, lps) in refs.items():
            scorers[key].set_reference(ids, lps)
        if refs:
            notes.append(f"each run scored against the FP32 full teacher-forced replay ({len(refs)} pairs)")
    notes = notes + read_variants(list(variants), scorers)
    tf = read_teacher(teacher, {p["key"]: p for p in pairs}) if teacher else {}
    if engine_replay:  # the engine's own replay rows (engine:cold / engine:warm:B), beside the HF ones
        for key, rows in read_teacher(engine_replay, {p["key"]: p for p in pairs}).items():
            tf.setdefault(key, {}).update(rows)
    out = []
    for p in pairs:
        counts, tk = scorers[p["key"]].counts, tf.get(p["key"], {})
        m = (mates or {}).get(p["key"], 0)
        kind, cause = verdict(p, counts, tk, b_dtype, m, None if calibration is None else calibration.ref_error_max)
        noise = (
            within_noise(p, calibration, counts) if kind in ("bug", "unresolved") and "beyond" not in cause else None
        )
        if noise is not None:
            was = cause.removeprefix("unresolved — ").removeprefix(NOT_REPRODUCED).strip()
            kind, cause = (
                "calibrated_noise",
                (
                    f"cause: this engine's calibrated noise — {noise}; not tipped by the sampled runs "
                    f"({was.strip('()')})"
                ),
            )
        if p.get("misreported") and kind in OK_KINDS:
            kind, cause = "bug", f"{MISREPORTED} — {p['misreported']}; the flip itself: {cause}"
        if run_finding and kind in OK_KINDS:
            kind, cause = "bug", f"{RUN_LEVEL} — {run_finding}; this pair alone: {cause}"
        loud = kind == "bug" and p["class"] in BENIGN
        right, side = right_side(p, tk, counts)
        ev = config_lines(counts)
        for label, part in (
            ("teacher-forced top-1 at t", {h: v for h, v in tk.items() if not h.startswith("engine:")}),
            ("engine's own replay, top-1 at t", {h: v for h, v in tk.items() if h.startswith("engine:")}),
        ):
            if part:
                ev.append(
                    f"{label}: "
                    + ", ".join(
                        f"{h} {'A' if v == p['token_a'] else 'B' if v == p['token_b'] else v}"
                        for h, v in sorted(part.items())
                    )
                )
        for c in counts.values():
            want = Variant.parse(c.variant).boundary_wanted
            if c.config == "engine" and want is not None and set(c.boundaries) - {want}:
                ev.append(f"{c.variant} runs reported reused prefixes {dict(c.boundaries)}, not only {want}")
        ba, bb = int(p["boundary_a"]), int(p["boundary_b"])
        va, vb = side_variant(counts, "engine", ba), side_variant(counts, "engine", bb)
        if ba != bb and va is not None and vb is not None and not (ran_at(va, ba) and ran_at(vb, bb)):
            ev.append(
                f"prefix reuse not tested: the alone runs reused {ran(va)} (A's boundary {where(ba)} asked) and "
                f"{ran(vb)} (B's {where(bb)} asked)"
            )
        if loud:
            cause = f"LOUD: classified {p['class']} (benign), but {cause}"
        out.append(
            PairExplanation(
                p["key"],
                p["class"],
                int(p["position"]),
                int(p["token_a"]),
                int(p["token_b"]),
                int(p["boundary_a"]),
                int(p["boundary_b"]),
                m,
                kind,
                cause,
                loud,
                right,
                side,
                tuple(counts.values()),
                tk,
                tuple(ev),
            )
        )
    return ExplainResult(str(a), str(b), tuple(out), tuple(skipped), tuple(notes), drift_nats)
