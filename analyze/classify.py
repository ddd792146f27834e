"""Classify every aligned pair by the divergence taxonomy, vectorised.

All per-position work runs on the concatenated rows of every pair [T] with
numpy; Python touches each pair at most once (to format its rule text). Top-k
rows are read only at the D divergence positions (evidence.py). A benign class
is a claim, and every part of it is checked (docs/analysis.md):

  incomparable   missing / failed / different prompt / sampled / unknown ids (align.py)
  identical      same ids, same length, drift within tolerance (max and mean), no
                 NaN or inf logprob on one side only
  post_eos       the first difference lies after an EOS in A (EOS ids known, never
                 guessed); the part up to the EOS is sound; neither stream truncated
  bf16_tie_flip  at t both tokens in both top-k; each side chose its own top-1; the
                 gap between them within the tie tolerance in each trace; both
                 candidates moved between A and B within the drift tolerance; logits
                 and logprobs agree; drift before t within tolerance
  cache_boundary as the tie, with boundaries that differ (both known) and gaps
                 within the drift tolerance instead of the tie tolerance
  unexplained    anything else, with every failed check named
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from tracekit.errors import ConfigError

from . import evidence
from .align import Alignment
from .grid import FLOOR_ABS
from .streams import truncation

CLASSES = ("incomparable", "identical", "post_eos", "bf16_tie_flip", "cache_boundary", "unexplained")


@dataclass(frozen=True)
class Tol:
    """The tolerances of one dtype (docs/analysis.md has the measurements behind them)."""

    tie_ulps: float  # gap between the two candidates, steps of the grid (raw logits)
    drift_ulps: float  # candidates' movement and cache_boundary gaps, steps (raw logits)
    tie_nats: float  # the same two, in nats, for logprobs only
    drift_nats: float  # also: max |Δ chosen logprob| before the difference
    drift_mean_nats: float  # mean |Δ chosen logprob|, with one spike of drift_nats allowed


# Measured on the reference engine (bench/grid_noise.py, docs/analysis.md): batching and a
# split prefill move BF16 and FP16 logits by <= 2 steps of their grid (flips at gaps <= 2
# steps), FP32 logits by <= 16 steps. tie_ulps is 2x (FP32 4x) that; drift_ulps 4x tie_ulps.
# The nats tolerances (logprobs only, and drift) are tie_ulps steps at |logit| in [16, 32),
# where real models' top logits sit (BF16: 4 x 0.125); the mean bound is 1/8 of the max.
DEFAULTS: dict[str, Tol] = {
    "bf16": Tol(4, 16, 0.5, 0.5, 0.0625),
    "fp16": Tol(4, 16, 2**-4, 2**-4, 2**-7),
    "fp32": Tol(64, 256, 2**-13, 2**-13, 2**-16),
}
OPTIONS = {f.name: "--" + f.name.replace("_", "-") for f in fields(Tol)}


@dataclass(frozen=True)
class Thresholds:
    """User overrides (None = the per-dtype default of DEFAULTS) and the grid floor."""

    tie_ulps: float | None = None
    drift_ulps: float | None = None
    tie_nats: float | None = None
    drift_nats: float | None = None
    drift_mean_nats: float | None = None
    grid_floor: float = FLOOR_ABS

    def __post_init__(self) -> None:
        for name in (*OPTIONS, "grid_floor"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        if not self.grid_floor > 0:
            raise ConfigError(f"--grid-floor must be > 0, got {self.grid_floor}")
        _check_order(self, "given")

    def given(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in OPTIONS if getattr(self, k) is not None}

    def for_dtype(self, dtype: str) -> Tol:
        tol = Tol(**{**asdict(DEFAULTS[dtype]), **self.given()})
        _check_order(tol, f"for {dtype}")
        return tol

    def to_json(self, dtypes) -> dict:
        return {
            "given": self.given(),
            "grid_floor": self.grid_floor,
            **{d: asdict(self.for_dtype(d)) for d in sorted(set(dtypes))},
        }


def _check_order(t, where: str) -> None:
    """The drift tolerances are the looser ones; the mean bound never exceeds the max."""
    for lo, hi in (("tie_ulps", "drift_ulps"), ("tie_nats", "drift_nats"), ("drift_mean_nats", "drift_nats")):
        a, b = getattr(t, lo), getattr(t, hi)
        if a is not None and b is not None and b < a:
            raise ConfigError(
                f"{OPTIONS[hi]} ({b:g} {where}) must be >= {OPTIONS[lo]} ({a:g}): pass both to change the order"
            )


def tol_columns(thr: Thresholds, dtypes: np.ndarray) -> dict[str, np.ndarray]:
    """Per pair [P] float arrays of each Tol field, from each pair's dtype name."""
    per = {d: thr.for_dtype(d) for d in set(dtypes.tolist())}
    return {f: np.array([getattr(per[d], f) for d in dtypes.tolist()], dtype=np.float64) for f in OPTIONS}


# -- per-position reductions over the concatenated rows [T] ------------------------


def first_divergence(al: Alignment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t [P] first differing position (= L when none), ta [T], tb [T] aligned ids)."""
    ta, tb = al.a.token_id[al.idx_a], al.b.token_id[al.idx_b]
    t = al.length.copy()
    mism = np.flatnonzero(ta != tb)
    segs, first = np.unique(al.seg[mism], return_index=True)
    t[segs] = al.pos[mism[first]]
    return t, ta, tb


@dataclass(frozen=True)
class Drift:
    """|Δ chosen logprob| over positions < end, per pair [P]: max and mean over the
    positions where both are finite (NaN when none), their count, positions where
    one side is NaN/inf and the other is not (a finding, never skipped) and the
    first of them (-1), and whether every chosen logprob is bitwise equal."""

    max: np.ndarray
    mean: np.ndarray
    n: np.ndarray
    nonfinite: np.ndarray
    nonfinite_pos: np.ndarray
    bitwise: np.ndarray
    nonfinite_a: np.ndarray  # [P] A's and B's logprob at nonfinite_pos (NaN when none)
    nonfinite_b: np.ndarray


def drift(al: Alignment, end: np.ndarray, la: np.ndarray, lb: np.ndarray) -> Drift:
    """A side that stored no finite logprob at all for a request (an engine asked
    for none) leaves its drift unmeasured (n = 0), not a finding."""
    P = len(end)
    dmax, mean = np.full(P, np.nan), np.full(P, np.nan)
    n, nf = np.zeros(P, np.int64), np.zeros(P, np.int64)
    nf_pos = np.full(P, -1, np.int64)
    bitwise = np.ones(P, bool)
    nz = np.flatnonzero(al.length > 0)
    nfa, nfb = np.full(P, np.nan), np.full(P, np.nan)
    if not len(nz):
        return Drift(dmax, mean, n, nf, nf_pos, bitwise, nfa, nfb)
    starts = al.start[nz]
    pre = al.pos < end[al.seg]
    fa, fb = np.isfinite(la), np.isfinite(lb)
    both = fa & fb & pre
    # NaN on both sides is "not recorded" (skipped); anything else non-finite on one side
    # only (NaN vs a value, inf vs a value, +inf vs -inf) is a finding.
    none_a = np.add.reduceat(fa, starts, dtype=np.int64) == 0
    none_b = np.add.reduceat(fb, starts, dtype=np.int64) == 0
    silent = np.zeros(P, bool)
    silent[nz] = none_a | none_b
    odd = pre & ~(fa & fb) & ~(np.isnan(la) & np.isnan(lb)) & ~(la == lb) & ~silent[al.seg]
    d = np.where(both, np.abs(la.astype(np.float64) - lb), 0.0)
    n[nz] = np.add.reduceat(both, starts, dtype=np.int64)
    dmax[nz] = np.maximum.reduceat(np.where(both, d, -1.0), starts)
    mean[nz] = np.add.reduceat(d, starts) / np.maximum(n[nz], 1)
    dmax[n == 0], mean[n == 0] = np.nan, np.nan
    nf[nz] = np.add.reduceat(odd, starts, dtype=np.int64)
    hit = np.flatnonzero(odd)
    segs, first = np.unique(al.seg[hit], return_index=True)
    nf_pos[segs] = al.pos[hit[first]]
    nfa[segs], nfb[segs] = la[hit[first]], lb[hit[first]]
    bits_differ = pre & (la.view(np.uint32) != lb.view(np.uint32))
    bitwise[nz] = np.add.reduceat(bits_differ, starts, dtype=np.int64) == 0
    return Drift(dmax, mean, n, nf, nf_pos, bitwise, nfa, nfb)


def drift_ok(d: Drift, tol: dict[str, np.ndarray]) -> np.ndarray:
    """Max within drift_nats, mean within drift_mean_nats + (drift_nats - drift_mean_nats) / n
    (one spike as large as the max bound never fails the mean; a shift at every
    position does), and no one-sided NaN/inf."""
    x, m = tol["drift_nats"], tol["drift_mean_nats"]
    mean_bound = m + (x - m) / np.maximum(d.n, 1)
    ok_max = np.isnan(d.max) | (d.max <= x)
    ok_mean = np.isnan(d.mean) | (d.mean <= mean_bound)
    return ok_max & ok_mean & (d.nonfinite == 0)


def eos_before(al: Alignment, ta: np.ndarray, t: np.ndarray, eos_ids: np.ndarray) -> np.ndarray:
    """[P] first position < t where A emitted an EOS id, -1 when none."""
    hit = np.flatnonzero(np.isin(ta, eos_ids) & (al.pos < t[al.seg]))
    out = np.full(len(t), -1, dtype=np.int64)
    segs, first = np.unique(al.seg[hit], return_index=True)
    out[segs] = al.pos[hit[first]]
    return out


def _take(col: np.ndarray, rows: np.ndarray, mask: np.ndarray, fill: int = -1) -> np.ndarray:
    """col[rows] where mask, else fill; safe when col is empty (every request failed)."""
    if not len(col) or not mask.any():
        return np.full(len(rows), fill, dtype=np.int64)
    return np.where(mask, col[np.where(mask, rows, 0)], fill)


# -- the classifier ------------------------------------------------------------------


EV_FLOAT = ("gap", "gap_ulp", "below", "below_ulp", "agree", "agree_tol", "move", "move_ulp")
EV_BOOL = ("greedy_ok", "tie_ok", "num_ok", "agree_ok", "move_ok", "own_in_topk")


def _evidence(al, t, div, token_a, token_b, bits, tol, tol_a, tol_b) -> dict[str, np.ndarray]:
    """Evidence columns [P] (NaN / False / -1 outside the D divergent pairs)."""
    P = len(t)
    ev: dict[str, np.ndarray] = {"topk_overlap": np.full(P, np.nan)}
    for s in ("a", "b"):
        for name in EV_FLOAT:
            ev[_col(name, s)] = np.full(P, np.nan)
        for name in EV_BOOL:
            ev[f"{name}_{s}"] = np.zeros(P, bool)
        ev[f"top1_{s}"] = np.full(P, -1, np.int64)
    ev["b_in_topk_a"], ev["a_in_topk_b"] = np.zeros(P, bool), np.zeros(P, bool)
    D = np.flatnonzero(div)
    if not len(D):
        return ev
    rows_a, rows_b = al.off_a[D] + t[D], al.off_b[D] + t[D]
    ids_a, lps_a, lg_a = evidence.fetch_rows(al.a, rows_a)
    ids_b, lps_b, lg_b = evidence.fetch_rows(al.b, rows_b)
    ra = evidence.side_row(ids_a, lps_a, lg_a, token_a[D], token_b[D], al.a.logprob[rows_a].astype(np.float64))
    rb = evidence.side_row(ids_b, lps_b, lg_b, token_b[D], token_a[D], al.b.logprob[rows_b].astype(np.float64))

    def sub(d):
        return {k: v[D] for k, v in d.items()}

    got = evidence.measure(ra, rb, bits[0][D], bits[1][D], bits[2][D], sub(tol), sub(tol_a), sub(tol_b))
    for k, v in got.items():
        ev[k][D] = v
    ev["topk_overlap"][D] = evidence.topk_overlap(ids_a, ids_b)
    return ev


def _col(name: str, s: str) -> str:
    """Column name of an evidence float: gap_a, gap_a_ulp, below_b_ulp, agree_tol_a, move_a, ..."""
    return f"{name[:-4]}_{s}_ulp" if name.endswith("_ulp") else f"{name}_{s}"


def classify(
    al: Alignment, thr: Thresholds, eos_ids: np.ndarray, dtypes: tuple[np.ndarray, np.ndarray]
) -> dict[str, np.ndarray]:
    """All result columns [P] except `rule` and `teacher`. dtypes: each side's
    dtype name per pair; the pair is judged on the coarser of the two grids."""
    from tracekit.dtypes import DTYPES

    P = len(al.keys)
    bits_a = np.array([DTYPES[d].mantissa_bits for d in dtypes[0].tolist()], dtype=np.int64)
    bits_b = np.array([DTYPES[d].mantissa_bits for d in dtypes[1].tolist()], dtype=np.int64)
    pair_dtype = np.where(bits_a <= bits_b, dtypes[0], dtypes[1])
    tol, tol_a, tol_b = tol_columns(thr, pair_dtype), tol_columns(thr, dtypes[0]), tol_columns(thr, dtypes[1])
    t, ta, tb = first_divergence(al)
    la, lb = al.a.logprob[al.idx_a], al.b.logprob[al.idx_b]
    comparable = al.incomparable == ""
    eos_pos = eos_before(al, ta, t, np.asarray(eos_ids, dtype=np.int64))
    main = drift(al, t, la, lb)  # the part both streams share
    sound = drift(al, np.where(eos_pos >= 0, eos_pos + 1, 0), la, lb)  # up to and including A's EOS
    main_ok, sound_ok = drift_ok(main, tol), drift_ok(sound, tol)
    # A side that stored no logprob at all for this request: drift cannot be checked (said).
    unverified = np.flatnonzero((main.n == 0) & (main.nonfinite == 0) & (t > 0))

    def bound(side, rows):
        return np.where(rows >= 0, side.table.cached_tokens[np.maximum(rows, 0)], -1)

    ba, bb = bound(al.a, al.row_a).astype(np.int64), bound(al.b, al.row_b).astype(np.int64)
    same_len = al.n_a == al.n_b
    identical = comparable & (t == al.length) & same_len
    div = comparable & (t < al.length)
    at = div | (comparable & (t == al.length) & ~same_len)  # or one side ended early
    has_a, has_b = at & (t < al.n_a), at & (t < al.n_b)
    token_a = _take(al.a.token_id, al.off_a + t, has_a)
    token_b = _take(al.b.token_id, al.off_b + t, has_b)
    ev = _evidence(al, t, div, token_a, token_b, (np.minimum(bits_a, bits_b), bits_a, bits_b), tol, tol_a, tol_b)

    # vLLM's check_logprobs_close: at the first difference each token is in the
    # other's top-k; sequences equal over zip() pass. 1 pass, 0 fail, -1 n/a.
    vllm = np.where(comparable, 1, -1).astype(np.int8)
    vllm[div] = (ev["b_in_topk_a"] & ev["a_in_topk_b"])[div]

    trunc_a, trunc_b = np.full(P, "", dtype=object), np.full(P, "", dtype=object)
    for i in np.flatnonzero(at & ~div | (at & (eos_pos >= 0))).tolist():
        trunc_a[i] = truncation(al.a, int(al.row_a[i]), int(al.n_a[i]), al.asked_a[i])
        trunc_b[i] = truncation(al.b, int(al.row_b[i]), int(al.n_b[i]), al.asked_b[i])
    not_cut = (trunc_a == "") & (trunc_b == "")

    def both(name):
        return ev[f"{name}_a"] & ev[f"{name}_b"]

    shared = div & both("greedy_ok") & both("move_ok") & both("agree_ok") & main_ok
    tie = shared & both("tie_ok")
    boundary_differs = (ba >= 0) & (bb >= 0) & (ba != bb)
    boundary = shared & boundary_differs & both("num_ok")
    post = at & (eos_pos >= 0) & sound_ok & not_cut

    cls = np.full(P, "unexplained", dtype=object)
    cls[boundary] = "cache_boundary"
    cls[tie] = "bf16_tie_flip"
    cls[post] = "post_eos"
    cls[identical & main_ok] = "identical"
    cls[~comparable] = "incomparable"
    note = np.full(P, "", dtype=object)
    for i in unverified.tolist():
        if comparable[i]:
            note[i] = "drift not verified: a side stored no logprob for this request"
    odd_after = post & ~(div & both("num_ok") & both("move_ok")) & div
    for i in np.flatnonzero(odd_after).tolist():
        note[i] = "after the EOS the streams differ by more than numeric noise (see gaps)"
    return dict(
        key=al.keys,
        cls=cls,
        position=np.where(at, t, -1),
        token_a=token_a,
        token_b=token_b,
        boundary_a=ba,
        boundary_b=bb,
        drift_max=main.max,
        drift_mean=main.mean,
        drift_n=main.n,
        drift_ok=main_ok,
        nonfinite=main.nonfinite,
        nonfinite_pos=main.nonfinite_pos,
        nonfinite_a=main.nonfinite_a,
        nonfinite_b=main.nonfinite_b,
        sound_nonfinite_pos=sound.nonfinite_pos,
        sound_drift_max=sound.max,
        sound_drift_n=sound.n,
        sound_drift_mean=sound.mean,
        sound_nonfinite=sound.nonfinite,
        sound_ok=sound_ok,
        bitwise=main.bitwise & comparable,
        vllm_close=vllm,
        len_a=al.n_a,
        len_b=al.n_b,
        compared=al.length,
        eos_pos=eos_pos,
        eos_id=_take(al.a.token_id, al.off_a + eos_pos, eos_pos >= 0),
        eos_known=np.full(P, len(eos_ids) > 0),
        incomparable=al.incomparable,
        dtype_a=dtypes[0],
        dtype_b=dtypes[1],
        dtype=pair_dtype,
        trunc_a=trunc_a,
        trunc_b=trunc_b,
        boundary_differs=boundary_differs,
        note=note,
        **{f"tol_{k}": v for k, v in tol.items()},
        **ev,
    )
