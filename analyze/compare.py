"""`diff(a, b)`: read two traces, align them by key, classify every pair.

Nothing here prints; diff_report.py formats a DiffResult. Readers opened here are
closed before returning (a DiffResult holds numbers only). This is also where
the facts a verdict depends on are gathered, each with its source: the EOS ids
(never guessed) and each trace's dtype (the grid its distances are counted on).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable

import numpy as np

from tracekit.calibration import Calibration
from tracekit.dtypes import DTYPES
from tracekit.errors import ConfigError, UsageError
from tracekit.store import TraceReader
from tracekit.verdicts import BENIGN

from .align import Side, align, load_side, parse_select
from .classify import Thresholds, classify
from .diff_setup import grids as side_grids
from .diff_setup import run_label, side_dtypes
from .eos_policy import ignore_eos_note
from .positions import with_scans
from .reported import reported_checks
from .result import DiffResult
from .sides import header_side
from .stream import POSITIONS, judge_chunks, pairs, streams
from .streams import context_notes

EOS_UNKNOWN = (
    "unknown: post_eos cannot fire; pass --eos ID or --tokenizer DIR (a model directory with "
    "generation_config.json or tokenizer_config.json)"
)


def _open(stack: contextlib.ExitStack, t: str | os.PathLike | TraceReader) -> TraceReader:
    if isinstance(t, TraceReader):
        return t
    return stack.enter_context(TraceReader(t))


def eos_ids(a: Side, b: Side, extra: Iterable[int] = (), tokenizer: str | None = None) -> tuple[tuple[int, ...], str]:
    """A's EOS ids (post_eos is a claim about A's stream) and where they came from:
    A's run metadata (the engine's self-report or the model's files read at
    capture), --eos, --tokenizer DIR; B's run metadata only when A names none; and
    failing all of these the model directory a run names when it exists here. Never
    inferred from the streams (a stop string is not an EOS)."""
    from tracekit.modelinfo import eos_token_ids

    found: list[tuple[str, set[int]]] = [
        ("A's run metadata", set(a.meta.eos_token_ids)),
        ("--eos", {int(x) for x in extra}),
    ]
    if tokenizer:
        d = os.path.dirname(tokenizer) if os.path.isfile(tokenizer) else tokenizer  # a tokenizer.json: its dir
        found.append((f"--tokenizer {tokenizer}", set(eos_token_ids(d or "."))))
    if not any(ids for _, ids in found) and b.meta.eos_token_ids:
        found.append(("B's run metadata (A names none)", set(b.meta.eos_token_ids)))
    if not any(ids for _, ids in found):
        for side in (a, b):
            for d in (side.meta.record.tokenizer, side.meta.record.model_dir):
                if d and os.path.isdir(d):
                    found.append((f"model files at {d} (named by the run metadata)", set(eos_token_ids(d))))
                    break
    ids = set().union(*(s for _, s in found))
    if not ids:
        return (), EOS_UNKNOWN
    return tuple(sorted(ids)), " + ".join(dict.fromkeys(src for src, s in found if s))


def _eos_note(a: Side, b: Side) -> str:
    ea, eb = set(a.meta.eos_token_ids), set(b.meta.eos_token_ids)
    if ea and eb and ea != eb:
        return f"A's and B's run metadata name different EOS ids ({sorted(ea)} vs {sorted(eb)}): A's are used"
    return ""


def _as_select(sel: str | dict | None) -> dict[str, str]:
    return parse_select(sel) if isinstance(sel, (str, type(None))) else dict(sel)


def diff(
    a: str | os.PathLike | TraceReader,
    b: str | os.PathLike | TraceReader,
    *,
    thresholds: Thresholds | None = None,
    a_select: str | dict | None = None,
    b_select: str | dict | None = None,
    eos: Iterable[int] = (),
    tokenizer: str | None = None,
    dtype: str | None = None,
    teacher: str | os.PathLike | TraceReader | None = None,
    calibration: Calibration | str | os.PathLike | None = None,
    reference: str | os.PathLike | TraceReader | None = None,
    reference_select: str | dict | None = None,
    stream_positions: int | None = POSITIONS,
    **tolerances: float | None,
) -> DiffResult:
    """Compare trace b with the reference a, request by request (paired by key).

    Tolerances: `thresholds`, or keywords of Thresholds (tie_ulps=, drift_nats=, ...);
    unset ones take the per-dtype defaults. a_select/b_select pick rows of a
    teacher-forced trace ("history=full,dtype=fp32"). eos / tokenizer: EOS ids and a
    model directory to read them from. dtype: judge both traces on this grid instead
    of the one their metadata names. teacher: a teacher-forced diagnostic trace; each
    divergent pair then says whether some cache history or dtype of it reproduces
    the flip (teacher.py). calibration: this engine's measured noise (a
    tracekit.calibration record or its path; `tracekit calibrate`): the run's flips are
    tested against its P(flip | gap) (flip_rate.py) and the result fails when they are
    more frequent, or at larger gaps, than the calibration predicts. reference: a
    higher-precision replay of A's tokens (the FP32 teacher-forced `full` rows, or the
    engine's FP32 trace): each side's error against it at every position p <= t
    (reference.py); a benign pair whose one side is systematically farther from it, or
    whose both sides are far from it, is `unexplained`. stream_positions: traces longer than
    this many token rows are judged a chunk of pairs of about that many rows at a time, never
    both whole in memory (stream.py; the same result; None: always whole).
    """
    if thresholds is not None and tolerances:
        raise ConfigError("pass either thresholds= or tolerance keywords, not both")
    thr = thresholds or Thresholds(**tolerances)
    cal_note = None
    if calibration is not None:
        from tracekit.calibration import read_calibration

        calibration = calibration if isinstance(calibration, Calibration) else read_calibration(calibration)
        thr, cal_note = calibrated_thresholds(thr, calibration)
    with contextlib.ExitStack() as stack:
        ra, rb = _open(stack, a), _open(stack, b)
        if os.path.abspath(ra.path) == os.path.abspath(rb.path) and not (a_select or b_select):
            raise UsageError(
                f"A and B are the same file ({ra.path}); pass two traces "
                "(or --a-select/--b-select to compare rows of one teacher-forced file)"
            )
        sel_a, sel_b = _as_select(a_select), _as_select(b_select)
        streamed = streams(ra, rb, stream_positions, teacher, reference)  # a chunk of pairs at a time
        if streamed:
            side_a, side_b = header_side(ra, sel_a, "a"), header_side(rb, sel_b, "b")
        else:
            side_a, side_b = load_side(ra, sel_a, "a", scan_rows=False), load_side(rb, sel_b, "b", scan_rows=False)
        ids, src = eos_ids(side_a, side_b, eos, tokenizer)
        al = pairs(side_a, side_b) if streamed else align(side_a, side_b)
        grid_a, grid_b, notes_a, notes_b = side_grids(side_a, side_b, dtype)
        for label, g, n, side in (("A", grid_a, notes_a, side_a), ("B", grid_b, notes_b, side_b)):
            if not g.known and side.meta.source != "teacher_forced":  # teacher-forced rows name their dtype
                n.append(
                    f"{label}: dtype {g.dtype} ({g.source}); distances are counted on that grid. Pass --dtype "
                    "(or record dtype in the run metadata) if it is wrong: an FP32 run judged on the BF16 grid "
                    "can hide a bug"
                )
        dt_a, more_a = side_dtypes(side_a, al.row_a, grid_a, dtype, "A")
        dt_b, more_b = side_dtypes(side_b, al.row_b, grid_b, dtype, "B")
        judge = _Judge(thr, np.asarray(ids, dtype=np.int64), (dt_a, dt_b), (bool(dtype), bool(dtype)))
        gaps = None
        if streamed:
            with_gaps = _gaps if calibration is not None else None
            cols, gaps = judge_chunks(al, stream_positions, judge, with_gaps)
        else:
            al = with_scans(al)  # the top-k pass, knowing the rows classify reads
            cols = judge(al)
        limited, limit_lines = context_notes(al)  # streams the engine stopped at its context limit
        for i, n in enumerate(limited):
            if n:
                cols["note"][i] = f"{cols['note'][i]}; {n}" if cols["note"][i] else n
        ref = None
        if reference is not None:
            ref = _against_reference(stack, al, cols, reference, reference_select, calibration)
        cols["teacher"] = np.full(len(cols["key"]), None, dtype=object)
        notes = [n for n in (side_a.note, side_b.note, _eos_note(side_a, side_b)) if n]
        notes += notes_a + more_a + notes_b + more_b + limit_lines
        if cols["drift_on_logits"].any():
            notes.append(
                f"{int(cols['drift_on_logits'].sum())} pair(s) store no logprobs: their drift is measured on the "
                "chosen tokens' raw logits, in steps"
            )
        if not ids:
            notes.append(f"EOS ids {EOS_UNKNOWN}")
        if eos_note := ignore_eos_note(side_a.meta, side_b.meta, cols, ids):  # engines ignore EOS differently
            notes.append(eos_note)
        if teacher is not None:
            from .teacher import cross_check

            cols["teacher"] = cross_check(_open(stack, teacher), al, cols)
            notes.append("teacher-forced verdicts are a cross-check; the classes come from the HTTP traces")
        grids = {"a": grid_a, "b": grid_b}
        labels = {"a": run_label(side_a), "b": run_label(side_b)}
        test = None
        if calibration is not None:
            test = _flip_test(gaps if gaps is not None else _gaps(al, cols), cols, calibration)
            notes.append(test.line())
            if cal_note:
                notes.append(cal_note)
        else:
            notes.append(UNCALIBRATED)
        if ref is not None:
            notes.append(reference_line(ref))
            if line := excused_line(cols, ref):
                notes.append(line)
        return DiffResult(ra.path, rb.path, thr, ids, src, cols, tuple(notes), grids, labels, test, ref)


UNCALIBRATED = (
    "uncalibrated: judged on the documented default tolerances (measured on the tiny CPU model); a deeper "
    "model's healthy noise can exceed them and a batched-path bug can hide under them. Measure this engine "
    "with `tracekit calibrate` and pass --calibration"
)


BENIGN_REFUTABLE = ("identical", *(v.value for v in BENIGN))  # classes a refuting check turns unexplained


def _refute(cols, reasons: np.ndarray, what: str) -> None:
    """Pairs with a reason: a benign class becomes `unexplained` (its rule kept after the
    reason); an `unexplained` one gets the reason added. Incomparable pairs stay as they are."""
    cols[f"refuted_{what}"] = reasons
    for i in np.flatnonzero(reasons != "").tolist():
        if cols["cls"][i] in BENIGN_REFUTABLE:
            cols["rule"][i] = f"{reasons[i]}; (otherwise {cols['cls'][i]}: {cols['rule'][i]})"
            cols["cls"][i] = "unexplained"
        elif cols["cls"][i] == "unexplained":
            cols["rule"][i] = f"{cols['rule'][i]}; {reasons[i]}"


def _against_reference(stack, al, cols, reference, select, calibration=None):
    """Each side against the reference; benign pairs it refutes become `unexplained`. "Both far"
    is judged on the calibration's healthy error against the reference when it measured one."""
    from .reference import against_reference, load_reference, reason

    ref_side, source = load_reference(_open(stack, reference), _as_select(select))
    t = np.where(cols["position"] >= 0, cols["position"], al.length).astype(np.int64)
    healthy = None
    if calibration is not None and calibration.ref_error_max is not None:
        healthy = {calibration.dtype: calibration.ref_error_max}
    ref = against_reference(al, t, cols["dtype"], ref_side, source, healthy)
    for i in np.flatnonzero(ref.note != "").tolist():
        cols["note"][i] = f"{cols['note'][i]}; {ref.note[i]}" if cols["note"][i] else ref.note[i]
        cols["rule"][i] = f"{cols['rule'][i]}; note: {ref.note[i]}"
    refuted = np.isin(ref.verdict, ("B farther", "A farther", "both far"))
    _refute(cols, np.array([reason(ref, i) if r else "" for i, r in enumerate(refuted)], dtype=object), "reference")
    _excuse_same_ids(cols, ref)
    return ref


def _excuse_same_ids(cols, ref) -> None:
    """Same ids, same length, complete, failed only by the size of their drift: when the reference
    finds A and B equally far from it (consistent, neither side farther, not both far, the run
    consistent too) and the drift is of the size of each side's own error against it, the drift is
    this engine's arithmetic (e.g. llama.cpp's f16 KV cache on an F32 GGUF: 8/8 `unexplained` on
    the fp32 grid, A and B 3.2e-4 nats from an FP32 replay each), not a difference between A and B:
    the pair is `identical`, its rule says so with the numbers (issue 22). "Of the size": the drift
    max within twice the smaller of the two sides' p99 errors."""
    cols["excused_reference"] = np.zeros(len(cols["cls"]), dtype=bool)
    if not ref.ok:
        return
    for i in np.flatnonzero(cols["cls"] == "unexplained").tolist():
        same = cols["position"][i] < 0 and cols["len_a"][i] == cols["len_b"][i] and cols["compared"][i] > 0
        clean = not cols["trunc_a"][i] and not cols["trunc_b"][i] and cols["nonfinite"][i] == 0
        clean = clean and cols["inconsistent"][i] == 0 and not cols["refuted_reference"][i]
        clean = clean and not cols["refuted_reported"][i]  # a misreport is never the engine's arithmetic
        # the drift within twice the *nearer* side's own p99 error: a spike on one side only is no
        # rounding of the same truth, whatever that side's own error then becomes
        scale = 2.0 * min(ref.p99_a[i], ref.p99_b[i])
        if not (
            same and clean and ref.verdict[i] == "" and np.isfinite(ref.ratio[i]) and cols["drift_max"][i] <= scale
        ):
            continue
        cols["cls"][i] = "identical"
        cols["excused_reference"][i] = True
        cols["rule"][i] = (
            f"same {int(cols['compared'][i])} token ids; drift max {cols['drift_max'][i]:.3g} / mean "
            f"{cols['drift_mean'][i]:.3g} nats beyond the {cols['dtype'][i]} tolerance "
            f"{cols['drift_tol'][i]:.3g} / {cols['drift_mean_tol'][i]:.3g}, but each side is as far from the reference "
            f"as the other: mean |Δlogprob| A {ref.err_a[i]:.3g} / B {ref.err_b[i]:.3g} nats (p99 {ref.p99_a[i]:.3g} / "
            f"{ref.p99_b[i]:.3g}; B/A {ref.ratio[i]:.3g}, 95% CI {ref.ratio_lo[i]:.3g}-{ref.ratio_hi[i]:.3g}): the "
            f"engine's own error against the reference, the same on both sides; both streams complete"
        )


def excused_line(cols, ref) -> str | None:
    """The run's line for pairs the reference called identical (None when there are none)."""
    ex = np.asarray(cols.get("excused_reference", ()), dtype=bool)
    if not ex.any():
        return None
    dt = sorted(set(cols["dtype"][ex].tolist()))
    return (
        f"{int(ex.sum())} pair(s) with the same ids drift beyond the {'/'.join(dt)} tolerance by no more than each "
        f"side's own error against the reference (median A {np.median(ref.err_a[ex]):.3g} / B "
        f"{np.median(ref.err_b[ex]):.3g} nats), A and B equally far: identical by the reference. This engine does "
        f"not compute its {'/'.join(dt)} logprobs exactly (measure its noise with `tracekit calibrate`)"
    )


def reference_line(ref) -> str:
    """The run's summary against the reference, one line."""
    ok = np.isfinite(ref.ratio)
    if not ok.any():
        return f"reference {ref.source}: no pair could be compared with it (keys or prompts differ)"
    v = ref.verdict[ok].tolist()
    counts = ", ".join(f"{k} {v.count(k)}" for k in ("B farther", "A farther", "both far") if v.count(k))
    notes = [] if ref.note is None else [str(n) for n in ref.note.tolist()]
    if n_far := sum(n.startswith("both sides") for n in notes):
        counts = (counts + "; " if counts else "") + (
            f"{n_far} pair(s) with the same rows on both sides above the default ceiling (not judged: calibrate "
            "with --reference)"
        )
    if n_within := sum("within this engine's healthy error" in n for n in notes):
        counts = (counts + "; " if counts else "") + (
            f"{n_within} pair(s) with one side farther from it than the other, but within this engine's healthy "
            "error against it (calibrated)"
        )
    p = min(ref.run_p_b, ref.run_p_a)
    left = f"; {ref.run_equal} pairs with the same rows on both sides left out" if ref.run_equal else ""
    run = {
        "": f"run-level: consistent (Wilcoxon over {ref.run_pairs} pairs' log B/A, p = {p:.2g}{left})",
        "too few pairs": f"run-level: not tested ({ref.run_pairs} pairs that differ, fewer than the test needs{left})",
    }.get(ref.run_verdict, f"run-level: {ref.run_verdict.upper()} (Wilcoxon over {ref.run_pairs} pairs, p = {p:.2g}")
    run += left + ")" if ref.run_verdict not in ("", "too few pairs") else ""
    return (
        f"reference {ref.source}: {int(ok.sum())} pairs, mean |Δlogprob| vs the reference A "
        f"{np.median(ref.err_a[ok]):.3g} / B {np.median(ref.err_b[ok]):.3g} nats (medians of pairs), "
        f"B/A ratio median {ref.run_median_ratio:.3g}; "
        + (counts or "every pair consistent with the reference")
        + (f" (both-far ceiling {ref.ceiling})" if ref.ceiling.startswith("calibrated") else "")
        + f"; {run}"
    )


def calibrated_thresholds(thr: Thresholds, cal: Calibration) -> tuple[Thresholds, str | None]:
    """The per-pair tolerances widened to this engine's measured noise, never narrowed (a
    narrower calibration is the run-level tests' job): the tie tolerance to the largest healthy
    flip gap, the drift bounds to twice the largest healthy drift, for pairs on the calibration's
    grid only. Tolerances the user gave are kept. Returns (thresholds, the note or None)."""
    import dataclasses

    if cal.dtype not in DTYPES:
        return thr, None
    base = thr.for_dtype(cal.dtype)

    got = {  # the largest healthy flip itself: a wider bin edge would excuse gaps nobody measured
        "tie_ulps": float(cal.flip_gap_max_steps or 0.0),
        "tie_nats": float(cal.flip_gap_max_nats),
        "drift_nats": 2.0 * float(cal.drift_max_nats.get("p100", 0.0) or 0.0),
        "drift_mean_nats": 2.0 * float(cal.drift_mean_nats.get("p100", 0.0) or 0.0),
    }
    got["drift_ulps"] = 4.0 * got["tie_ulps"]
    wider = {k: v for k, v in got.items() if np.isfinite(v) and v > getattr(base, k) and k not in thr.given()}
    new = {k: max(getattr(base, k), wider.get(k, 0.0)) for k in ("tie_ulps", "drift_ulps", "tie_nats")}
    new |= {k: max(getattr(base, k), wider.get(k, 0.0)) for k in ("drift_nats", "drift_mean_nats")}
    new["drift_ulps"] = max(new["drift_ulps"], new["tie_ulps"])
    new["drift_nats"] = max(new["drift_nats"], new["tie_nats"], new["drift_mean_nats"])
    keep = {k: v for k, v in new.items() if k in wider or k in ("drift_ulps", "drift_nats")}
    keep = {k: v for k, v in keep.items() if v != getattr(base, k) and k not in thr.given()}
    # only for pairs on the calibration's own grid: a BF16 engine's noise says nothing of an FP32 run
    out = dataclasses.replace(thr, measured=((cal.dtype, tuple(sorted(keep.items()))),) if keep else ())
    said = [f"{k} {getattr(base, k):g} -> {keep[k]:g}" for k in keep]
    move = _tie_move(cal, thr, out.for_dtype(cal.dtype))
    if move is not None:
        out = dataclasses.replace(out, tie_move=((cal.dtype, move[0], move[1]),))
        said.append(move[2])
    if not said:
        return thr, None
    return out, (
        f"tolerances widened to this engine's measured noise for {cal.dtype} pairs (calibration {cal.name}): "
        + ", ".join(said)
    )


def _tie_move(cal: Calibration, thr: Thresholds, tie) -> tuple[float, float, str] | None:
    """(steps, nats, what) of the gap-move tie: a flip whose A's gap + B's gap is within the largest
    top-2 gap move of this engine's healthy pairs (p100 over every compared position: a large sample,
    e.g. 608 pairs x 32 positions) is a tie, wherever its single gaps lie. The run-level flip test
    stays the guard against too many such flips. None when the calibration measured no move or the
    user gave a tie tolerance (kept as given); a unit whose move is within the per-side tie (`tie`,
    the widened Tol) adds nothing there (each gap <= the sum) and is left off (0)."""
    gm = cal.gap_move_max
    if gm is None or {"tie_ulps", "tie_nats"} & set(thr.given()):
        return None
    nats, steps = gm
    steps = steps if steps is not None and steps > tie.tie_ulps else 0.0
    nats = nats if nats > tie.tie_nats else 0.0
    if nats <= 0 and steps <= 0:
        return None
    unit = " / ".join(x for x in (f"{steps:g} steps" if steps else "", f"{nats:.3g} nats" if nats else "") if x)
    n = cal.gap_move.get("n", 0)
    return (
        steps,
        nats,
        f"a flip whose A's + B's gap is within the healthy top-2 gap move p100 {unit} ({n} positions) is a tie",
    )


class _Judge:
    """Classify an alignment's pairs and refute by the reported rows: the verdict columns of the
    pairs `sl` of the whole diff (a chunk's, when it streams)."""

    def __init__(self, thr: Thresholds, eos: np.ndarray, dtypes: tuple, fixed: tuple[bool, bool]):
        self.thr, self.eos, self.dtypes, self.fixed = thr, eos, dtypes, fixed

    def __call__(self, al, sl: slice = slice(None)) -> dict:
        cols = classify(al, self.thr, self.eos, (self.dtypes[0][sl], self.dtypes[1][sl]), self.fixed)
        _refute(cols, reported_checks(al), "reported")
        return cols


def _gaps(al, cols):
    """The calibrated flip test's trials of an alignment's pairs (flip_rate.position_gaps)."""
    from .flip_rate import position_gaps

    t = np.where(cols["position"] >= 0, cols["position"], al.length).astype(np.int64)
    comparable = cols["incomparable"] == ""
    bits = np.array([DTYPES[d].mantissa_bits for d in cols["dtype"].tolist()], dtype=np.int64)
    return position_gaps(al, t, comparable, bits)


def _flip_test(gaps, cols, calibration):
    from tracekit.calibration import read_calibration

    from .flip_rate import flip_test

    cal = calibration if isinstance(calibration, Calibration) else read_calibration(calibration)
    comparable = cols["incomparable"] == ""
    dts = cols["dtype"][comparable].tolist() or ["unknown"]
    main = max(set(dts), key=dts.count)
    return flip_test(gaps, cols["key"], cal, main)
