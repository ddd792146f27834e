"""Per-position reductions over the concatenated rows of every pair [T] -> [P].

First differences, EOS positions and drift, each a few whole-array numpy
operations and `reduceat`s; nothing here loops over pairs.

Drift is measured on the chosen tokens' logprobs: the logprob column, where it
is NaN the same token's entry in its own top-k row (a capture that left the
column empty still shows it there). A position where the column and the top-k
row disagree is a finding. For a pair where a side holds no logprob at all but
both traces hold raw logits (vLLM `--logprobs-mode raw_logits`), drift is
measured on the chosen tokens' raw logits instead, in steps of the pair's grid
(also when only some positions lack a logprob: one unit per pair).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .align import Alignment
from .align import segments as _segments
from .grid import steps
from .sides import scanned

COLUMN_VS_TOPK_NATS = 1e-4  # the column and the top-k row come from one response: equal but for rounding


def first_divergence(al: Alignment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t [P] first differing position (= L when none), ta [T], tb [T] aligned ids)."""
    if al.first is not None:
        return al.first
    ta, tb = al.take_a(al.a.token_id), al.take_b(al.b.token_id)
    t = al.length.copy()
    mism = np.flatnonzero(ta != tb)
    segs, first = np.unique(al.seg[mism], return_index=True)
    t[segs] = al.pos[mism[first]]
    return t, ta, tb


def with_scans(al: Alignment) -> Alignment:
    """The alignment over both sides after their top-k pass (sides.scanned), each keeping its
    top-k rows at the pairs' first differences: the only rows classify reads (evidence.py),
    taken from the pass instead of reading (and checksumming) their chunks again."""
    first = first_divergence(al)
    t = first[0]
    d = np.flatnonzero(t < al.length)
    a, b = scanned(al.a, al.off_a[d] + t[d]), scanned(al.b, al.off_b[d] + t[d])
    return dataclasses.replace(al, a=a, b=b, first=first)


def eos_before(al: Alignment, ta: np.ndarray, t: np.ndarray, eos_ids: np.ndarray) -> np.ndarray:
    """[P] first position < t where A emitted an EOS id, -1 when none."""
    hit = np.flatnonzero(np.isin(ta, eos_ids) & (al.pos < al.per_row(t)))
    out = np.full(len(t), -1, dtype=np.int64)
    segs, first = np.unique(al.seg[hit], return_index=True)
    out[segs] = al.pos[hit[first]]
    return out


@dataclass(frozen=True)
class Values:
    """The chosen tokens' values at every compared position [T], per side, and per
    pair [P] whether they are raw logits (counted in steps) instead of logprobs."""

    a: np.ndarray
    b: np.ndarray
    lp_a: np.ndarray  # [T] the chosen logprobs (column, else top-k row): findings are read here
    lp_b: np.ndarray
    on_logits: np.ndarray  # [P] bool
    inconsistent: np.ndarray  # [T] bool: the logprob column contradicts the top-k row
    said: np.ndarray  # [m, 3] at the m such positions: side (0 A, 1 B), the column's value, the row's
    said_at: np.ndarray  # [m] those positions (sorted): a finding is rare, [T, 3] would be mostly NaN
    # Per position, whatever the end of the compared part (drift() masks by position):
    finite: np.ndarray | None = None  # [T] both values finite
    odd: np.ndarray | None = None  # [T] a one-sided NaN/inf (a finding)
    delta: np.ndarray | None = None  # [T] |Δ value|: nats, or steps for pairs on logits
    raw: np.ndarray | None = None  # [T] |Δ value| in the values' own unit
    differ: np.ndarray | None = None  # [T] the values differ bitwise
    bits: np.ndarray | None = None  # [P] significand bits of each pair's grid


def chosen_values(al: Alignment, bits: np.ndarray) -> Values:
    """bits: [P] significand bits of each pair's grid (for pairs measured on logits)."""
    P = len(al.keys)
    col_a, col_b = al.take_a(al.a.logprob), al.take_b(al.b.logprob)
    top_a, top_b = al.take_a(al.a.topk_lp), al.take_b(al.b.topk_lp)
    bad = np.zeros(len(col_a), bool)
    found = []
    for side, (col, top) in enumerate(((col_a, top_a), (col_b, top_b))):
        # NaN compares False: only positions where both are known can disagree (-inf on both
        # sides agrees: its difference is NaN, quietly). Equal values never disagree: the
        # tolerance is computed where they differ (rare: the column and the row are one response).
        cand = np.flatnonzero(col != top)
        with np.errstate(invalid="ignore"):
            c, r = col[cand], top[cand]
            off = cand[np.abs(c - r) > COLUMN_VS_TOPK_NATS * np.maximum(1, np.abs(r))]
        bad[off] = True
        found.append(off)
    said_at = np.union1d(*found)  # where both sides disagree, A's numbers are said
    said = np.full((len(said_at), 3), np.nan)
    for side, off, (col, top) in ((1, found[1], (col_b, top_b)), (0, found[0], (col_a, top_a))):
        j = np.searchsorted(said_at, off)
        said[j, 0], said[j, 1], said[j, 2] = side, col[off], top[off]
    # (a column without a NaN, the common case, is its own values: no [T] where)
    nan_a, nan_b = np.isnan(col_a), np.isnan(col_b)
    va = np.where(nan_a, top_a, col_a) if nan_a.any() else col_a
    vb = np.where(nan_b, top_b, col_b) if nan_b.any() else col_b
    lp_a, lp_b = va, vb
    on_logits = np.zeros(P, bool)
    nz = np.flatnonzero(al.length > 0)
    if len(nz) and al.a.has_logits and al.b.has_logits and va is not col_a and vb is not col_b:
        # A pair with a position where neither side recorded a logprob (neither in the
        # column nor in its top-k row) is measured on raw logits throughout, when both
        # traces hold them: one unit per pair, and no unrecorded position escapes. (Only where
        # both columns have a NaN: a NaN-free column's values are all recorded.)
        missing = np.add.reduceat(np.isnan(va) & np.isnan(vb), al.start[nz]) > 0
        on_logits[nz] = missing
        if on_logits.any():
            rows = al.per_row(on_logits)
            la, lb = al.a.chosen_logits(), al.b.chosen_logits()
            va = np.where(rows, al.take_a(la), va)
            vb = np.where(rows, al.take_b(lb), vb)
    return _per_position(al, Values(va, vb, lp_a, lp_b, on_logits, bad, said, said_at, bits=bits))


def _per_position(al: Alignment, v: Values) -> Values:
    """The [T] masks and distances every drift() call reduces (computed once)."""
    P, la, lb = len(al.keys), v.a, v.b
    nz = np.flatnonzero(al.length > 0)
    starts = al.start[nz]
    odd = np.zeros(len(la), bool)
    finite_lp = None
    # One-sided NaN/inf is a finding, read on the logprobs (and on the logits for pairs
    # measured on them). A side that recorded no logprob at all for a request: not a finding.
    for xa, xb, only in ((v.lp_a, v.lp_b, None), (la, lb, v.on_logits)):
        if only is not None and not only.any():
            continue
        fin = np.isfinite(xa) & np.isfinite(xb)
        finite_lp = fin if only is None else finite_lp
        cand = np.flatnonzero(~fin)  # only a position with a non-finite value can be one
        if not len(cand):
            continue
        a, b = xa[cand], xb[cand]
        o = ~(np.isnan(a) & np.isnan(b)) & ~(a == b)
        if only is None:
            silent = np.zeros(P, bool)
            if len(nz):
                silent[nz] = (np.add.reduceat(~np.isnan(xa), starts) == 0) | (
                    np.add.reduceat(~np.isnan(xb), starts) == 0
                )
            o &= ~silent[al.seg[cand]]
        else:
            o &= only[al.seg[cand]]
        odd[cand[o]] = True
    raw = np.subtract(la, lb, dtype=np.float64)  # = la.astype(float64) - lb, in one pass
    np.abs(raw, out=raw)
    delta = raw
    logit_rows = al.per_row(v.on_logits)
    if logit_rows.any():  # raw logits: steps of the pair's grid at each value's own scale
        s = np.abs(steps(la, lb, al.per_row(v.bits), np.fmax(np.abs(la), np.abs(lb))))
        delta = np.where(logit_rows, s, raw)
    return dataclasses.replace(
        v,
        finite=finite_lp if la is v.lp_a and lb is v.lp_b else np.isfinite(la) & np.isfinite(lb),
        odd=odd,
        delta=delta,
        raw=raw,
        differ=la.view(np.uint32) != lb.view(np.uint32),
    )


@dataclass(frozen=True)
class Drift:
    """Over positions < end, per pair [P]: max and mean |Δ value| over the positions
    where both are finite (NaN when none; nats, or steps for pairs on logits), their
    count; positions where one side is NaN/inf and the other is not, or where a
    side's logprob column contradicts its top-k row (findings, never skipped), with
    the first of each (-1) and both values there; whether every value is bitwise equal."""

    max: np.ndarray
    mean: np.ndarray
    n: np.ndarray
    nonfinite: np.ndarray
    nonfinite_pos: np.ndarray
    nonfinite_a: np.ndarray
    nonfinite_b: np.ndarray
    inconsistent: np.ndarray
    inconsistent_pos: np.ndarray
    inconsistent_said: np.ndarray  # [P, 3] side, column value, top-k value at the first
    bitwise: np.ndarray
    raw_max: np.ndarray  # [P] max |Δ value| in the values' own unit (logits for pairs on logits)


def drift(al: Alignment, end: np.ndarray, v: Values, skip: bool = False) -> Drift:
    """Reduce the per-position values over positions < end, per pair.
    skip: end is 0 for every pair (nothing before it): the empty result at once."""
    P = len(end)
    dmax, mean = np.full(P, np.nan), np.full(P, np.nan)
    n, nf, inc = (np.zeros(P, np.int64) for _ in range(3))
    nfa, nfb = np.full(P, np.nan), np.full(P, np.nan)
    bitwise = np.ones(P, bool)
    raw_max = np.full(P, np.nan)
    nf_pos, inc_pos, said = np.full(P, -1), np.full(P, -1), np.full((P, 3), np.nan)
    # a pair with no position before its end keeps the empty values: only the others are reduced
    nz = np.flatnonzero((al.length > 0) & (end > 0))
    if skip or not len(nz):
        return Drift(dmax, mean, n, nf, nf_pos, nfa, nfb, inc, inc_pos, said, bitwise, raw_max)
    sub = _Rows(al, nz)
    nz = sub.nz
    pre = sub.pos < np.repeat(end[nz], sub.length)
    both = sub(v.finite) & pre
    delta = sub(v.delta)
    n[nz] = np.add.reduceat(both, sub.start, dtype=np.int64)
    dmax[nz] = np.maximum.reduceat(np.where(both, delta, -1.0), sub.start)
    # (each pair's whole segment summed, zeros past its end: the same sum, bit for bit, as before)
    mean[nz] = np.add.reduceat(np.where(both, delta, 0.0), sub.start) / np.maximum(n[nz], 1)
    if v.raw is v.delta:  # no pair on logits: the raw distances are the distances
        raw_max[nz] = dmax[nz]
    else:
        raw_max[nz] = np.maximum.reduceat(np.where(both, sub(v.raw), -1.0), sub.start)
    dmax[n == 0], mean[n == 0], raw_max[n == 0] = np.nan, np.nan, np.nan
    if v.odd.any():  # a finding (rare): counted, the first one's values said
        odd = sub(v.odd) & pre
        nf[nz] = np.add.reduceat(odd, sub.start, dtype=np.int64)
        nf_pos, idx = sub.first(odd, P)
        has = idx >= 0
        nfa[has], nfb[has] = v.lp_a[idx[has]], v.lp_b[idx[has]]
    if v.inconsistent.any():
        bad = sub(v.inconsistent) & pre
        inc[nz] = np.add.reduceat(bad, sub.start, dtype=np.int64)
        inc_pos, inc_idx = sub.first(bad, P)
        has = inc_idx >= 0
        said[has] = v.said[np.searchsorted(v.said_at, inc_idx[has])]
    bitwise[nz] = np.add.reduceat(sub(v.differ) & pre, sub.start, dtype=np.int64) == 0
    return Drift(dmax, mean, n, nf, nf_pos, nfa, nfb, inc, inc_pos, said, bitwise, raw_max)


class _Rows:
    """The [T] rows drift() reduces, laid end to end: all of [T] when pairs `nz` (each with a
    position before its end) hold most of it, else a gather of their segments only (the drift
    up to an EOS: a few pairs). Either way each reduced pair's whole segment, in order. start:
    each reduced pair's first row there; first(): per pair [P] the first position where a mask
    holds and its index in [T]."""

    def __init__(self, al: Alignment, nz: np.ndarray):
        self.al = al
        if 2 * int(al.length[nz].sum()) >= len(al.pos):
            self.nz, self.rows, self.pos = np.flatnonzero(al.length > 0), None, al.pos
        else:
            seg, pos, _ = _segments(al.length[nz])
            self.nz, self.rows, self.pos = nz, al.start[nz][seg] + pos, pos
        self.length = al.length[self.nz]
        self.start = np.cumsum(self.length) - self.length

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x if self.rows is None else x[self.rows]

    def first(self, mask: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
        hit = np.flatnonzero(mask)
        pos, idx = np.full(P, -1, np.int64), np.full(P, -1, np.int64)
        if not len(hit):
            return pos, idx
        seg = np.searchsorted(self.start, hit, side="right") - 1  # the reduced pair of each hit
        segs, first = np.unique(seg, return_index=True)
        at = hit[first] if self.rows is None else self.rows[hit[first]]
        pos[self.nz[segs]], idx[self.nz[segs]] = self.al.pos[at], at
        return pos, idx


def drift_ok(d: Drift, x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Max within x, mean within m + (x - m) / n (one spike as large as the max bound
    never fails the mean; a shift at every position does), and no finding."""
    mean_bound = m + (x - m) / np.maximum(d.n, 1)
    ok_max = np.isnan(d.max) | (d.max <= x)
    ok_mean = np.isnan(d.mean) | (d.mean <= mean_bound)
    return ok_max & ok_mean & (d.nonfinite == 0) & (d.inconsistent == 0)
