"""`tracekit calibrate`: measure one engine's noise from healthy repeats.

Each (A, B) pair of traces is two runs of the same prompts on the same engine, model and
dtype that should agree (serial vs serial, burst vs burst, serial vs burst on a healthy
build, --batch-invariant vs default). For every pair of requests it counts the trials and
flips of P(flip | gap) (flip_rate.position_gaps), the drift before the difference, how far
the top-2 gap moves between the two runs at every position before it (`gap_moves`), and, given
a higher-precision reference of the A traces' tokens (`reference=`, selected as diff's), each
healthy side's mean error against it (analyze/reference.py). The
result is a `tracekit.calibration/2` record (tracekit/calibration.py) that `tracekit diff
--calibration` judges a run against. Only healthy runs may go in: a calibration measured on
a broken engine excuses its bug (say where the repeats came from in `--name`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from collections.abc import Sequence

import numpy as np

from tracekit import __version__
from tracekit.calibration import NATS_EDGES, STEP_EDGES, Calibration, GapBins
from tracekit.dtypes import DTYPES
from tracekit.errors import ConfigError
from tracekit.files import sha256_file
from tracekit.percentiles import percentiles
from tracekit.store import TraceReader

from .align import align, load_side
from .compare import diff

QUANTILES = (50, 90, 99, 100)


def gap_moves(al, t: np.ndarray, comparable: np.ndarray, bits: np.ndarray):
    """(nats [M], steps [M] or None): |g_A - g_B'| at every position p < t of each comparable pair
    where both rows hold both candidates; g_A is A's top-1 minus A's runner-up, g_B' the same two
    ids in B's row (logprobs; logits counted in steps of the pair's grid at A's row scale)."""
    from .grid import steps

    end = np.where(comparable, np.minimum(t, al.length), 0)
    pair = np.repeat(np.arange(len(end)), end)
    pos = np.arange(int(end.sum()), dtype=np.int64) - (np.cumsum(end) - end)[pair]
    if not len(pair):
        return np.zeros(0), (np.zeros(0) if al.a.has_logits and al.b.has_logits else None)
    ra, rb = al.off_a[pair] + pos, al.off_b[pair] + pos
    ids_a, ids_b = al.a.reader.column("topk_id")[ra], al.b.reader.column("topk_id")[rb]

    def pick(vals_a, vals_b):
        va = np.where(np.isfinite(vals_a), vals_a, -np.inf).astype(np.float64)
        order = np.argsort(-va, axis=1)[:, :2]
        c = np.take_along_axis(ids_a, order, 1)  # A's top-1 and runner-up ids [M, 2]
        in_a = np.take_along_axis(va, order, 1)
        match = (ids_b[:, None, :] == c[:, :, None]) & (c[:, :, None] >= 0)  # [M, 2, k]
        vb = np.where(np.isfinite(vals_b), vals_b, -np.inf).astype(np.float64)
        in_b = np.take_along_axis(vb, match.argmax(2), 1)
        ok = match.any(2).all(1) & np.isfinite(in_a).all(1) & np.isfinite(in_b).all(1)
        return in_a, in_b, ok

    la, lb = al.a.reader.column("topk_logprob")[ra], al.b.reader.column("topk_logprob")[rb]
    a2, b2, ok = pick(la, lb)
    nats = np.abs((a2[:, 0] - a2[:, 1]) - (b2[:, 0] - b2[:, 1]))[ok]
    st = None
    if al.a.has_logits and al.b.has_logits:
        ga, gb = al.a.reader.column("topk_logit")[ra], al.b.reader.column("topk_logit")[rb]
        a2, b2, ok = pick(ga, gb)
        scale = np.nanmax(np.abs(np.where(np.isfinite(ga), ga, np.nan)), axis=1)
        bb = bits[pair]
        mv = steps(a2[:, 0], a2[:, 1], bb, scale) - steps(b2[:, 0], b2[:, 1], bb, scale)
        st = np.abs(mv[ok]).astype(np.float64)
    return nats, st


def _pair_gaps(a: str, b: str, **diff_kwargs):
    """(the diff, its PositionGaps, its gap moves (nats, steps)) of one healthy pair of traces."""
    from .flip_rate import position_gaps

    res = diff(a, b, **diff_kwargs)
    c = res.columns
    with contextlib.ExitStack() as stack:
        ra = stack.enter_context(TraceReader(a))
        rb = stack.enter_context(TraceReader(b))
        al = align(load_side(ra, {}, "a"), load_side(rb, {}, "b"))
        t = np.where(c["position"] >= 0, c["position"], al.length).astype(np.int64)
        comparable = c["incomparable"] == ""
        bits = np.array([DTYPES[d].mantissa_bits for d in c["dtype"].tolist()], dtype=np.int64)
        return res, position_gaps(al, t, comparable, bits), gap_moves(al, t, comparable, bits)


def measure(
    pairs: Sequence[tuple[str, str]],
    name: str,
    *,
    reference: str | os.PathLike | None = None,
    reference_select: str | dict | None = None,
    **diff_kwargs,
) -> Calibration:
    """The calibration of the engine that wrote these healthy pairs of traces. `reference`: a
    higher-precision replay of the A traces' tokens (as `diff --reference`): each healthy side's
    mean error against it is measured too (pairs it holds no row for are left out, counted)."""
    if not pairs:
        raise ConfigError("calibrate: give at least one pair of healthy traces (A B)")
    nats, nat_flips, step, step_flips, dmax, dmean = [], [], [], [], [], []
    mv_nats, mv_steps, ref_err, no_ref, ref_source = [], [], [], 0, ""
    dtypes, engines, sources, incomparable, n_pairs = set(), [], [], 0, 0
    if reference is not None:
        diff_kwargs = {**diff_kwargs, "reference": reference, "reference_select": reference_select}
    for a, b in pairs:
        res, g, (mn, ms) = _pair_gaps(a, b, **diff_kwargs)
        c = res.columns
        ok = c["incomparable"] == ""
        incomparable += int((~ok).sum())
        n_pairs += int(ok.sum())
        nats.append(g.nats)
        nat_flips.append(g.flip_nats)
        if g.steps is not None:
            step.append(g.steps)
            step_flips.append(g.flip_steps)
        dmax.append(c["drift_max"][ok])
        dmean.append(c["drift_mean"][ok])
        mv_nats.append(mn)
        if ms is not None:
            mv_steps.append(ms)
        if res.reference is not None:
            rr = res.reference
            have = ok & np.isfinite(rr.err_a) & np.isfinite(rr.err_b)
            no_ref += int((ok & ~have).sum())
            ref_err += [rr.err_a[have], rr.err_b[have]]
            ref_source = rr.source
        dtypes.update(c["dtype"][ok].tolist())
        engines.append(res.labels.get("a", ""))
        sources.append({"a": str(a), "b": str(b), "a_sha256": sha256_file(a), "b_sha256": sha256_file(b)})
    if n_pairs == 0:
        raise ConfigError("calibrate: no comparable pair of requests in the given traces (see `tracekit diff`)")
    if len(dtypes) > 1:
        raise ConfigError(f"calibrate: the traces ran on several grids ({', '.join(sorted(dtypes))}); one dtype a file")
    all_nats, all_nat_flips = np.concatenate(nats), np.concatenate(nat_flips)
    trials, flips = _bins(all_nats, all_nat_flips, NATS_EDGES)
    steps_bins, gmax_steps = None, None
    if step and len(step) == len(pairs):
        all_steps, all_step_flips = np.concatenate(step), np.concatenate(step_flips)
        st, sf = _bins(all_steps, all_step_flips, STEP_EDGES)
        steps_bins = GapBins("steps", STEP_EDGES, st, sf)
        gmax_steps = _max_or_zero(all_step_flips)
    notes = [f"{incomparable} incomparable request pair(s) left out"] if incomparable else []
    moves = np.concatenate(mv_nats)
    gap_move = {
        "n": int(len(moves)),
        "nats": percentiles(moves, QUANTILES, 9) if len(moves) else None,
        "steps": percentiles(np.concatenate(mv_steps), QUANTILES, 9)
        if mv_steps and len(mv_steps) == len(pairs) and len(moves)
        else None,
    }
    ref_error = None
    if reference is not None:
        errs = np.concatenate(ref_err) if ref_err else np.zeros(0)
        if not len(errs):
            raise ConfigError(
                f"calibrate: the reference {reference} holds no row for any pair's keys; give the replay "
                "of the A traces' tokens (capture --teacher-forced MODEL --from A.h5)"
            )
        ref_error = {"reference": ref_source, "n": int(len(errs)), "mean_nats": percentiles(errs, QUANTILES, 9)}
        if no_ref:
            notes.append(f"{no_ref} pair(s) without a reference row left out of the error vs the reference")
    return Calibration(
        name=name,
        dtype=dtypes.pop(),
        engine={"labels": sorted(set(engines))},
        pairs=n_pairs,
        flip_nats=GapBins("nats", NATS_EDGES, trials, flips),
        flip_steps=steps_bins,
        drift_max_nats=percentiles(np.concatenate(dmax), QUANTILES, 9),
        drift_mean_nats=percentiles(np.concatenate(dmean), QUANTILES, 9),
        flip_gap_max_nats=_max_or_zero(all_nat_flips),
        flip_gap_max_steps=gmax_steps,
        sources=tuple(sources),
        created_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        writer=f"tracekit {__version__}",
        notes=tuple(notes),
        gap_move=gap_move if len(moves) else None,
        ref_error=ref_error,
    )


def _bins(gaps, flips_at, edges):
    from .flip_rate import bin_counts

    return bin_counts(gaps, flips_at, edges)


def _max_or_zero(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.max()) if len(x) else 0.0


def default_name(path: str | os.PathLike) -> str:
    return os.path.splitext(os.path.basename(str(path)))[0]
