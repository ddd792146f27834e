"""Classify every aligned pair by the divergence taxonomy, vectorised.

All per-position work runs on the concatenated rows of every pair [T] with
numpy; Python touches each pair at most once (to format its rule text). Top-k
rows are read only at the D divergence positions (evidence.py). A benign class
is a claim, and every part of it is checked (docs/analysis.md):

  incomparable   missing / failed / ambiguous key / different prompt / sampled /
                 asked differently / replayed other tokens / unknown ids (align.py)
  identical      same ids, same length, drift within tolerance (max and mean), no
                 NaN or inf logprob on one side only, column agrees with top-k
  post_eos       the first difference lies after an EOS in A (A's EOS ids, never
                 guessed; not refuted by a stream that went on without ignoring EOS);
                 the part up to the EOS is sound. Or it lies at an EOS (one of A's ids)
                 that one side emitted and the other, a llama.cpp stream run with
                 ignore_eos, ranks first and skipped for its best non-EOS token
                 (eos_policy.skipped_eos: each part checked, as for a flip)
  bf16_tie_flip  at t both tokens in both top-k; sane rows; each side chose its own
                 top-1 (by logit and by logprob); the gap between them within the
                 tie tolerance in each trace; both candidates moved between A and B
                 within the drift tolerance; logits and logprobs agree; drift before t
  cache_boundary as the tie, with valid boundaries that differ and gaps within the
                 drift tolerance instead of the tie tolerance
  unexplained    anything else, with every failed check named
Every benign class also needs both streams complete (streams.truncation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from tracekit.dtypes import DTYPES
from tracekit.errors import ConfigError
from tracekit.verdicts import PRECEDENCE

from . import evidence
from .align import Alignment
from .eos_policy import skipped_eos
from .grid import FLOOR_ABS, on_grid
from .positions import chosen_values, drift, drift_ok, eos_before, first_divergence
from .streams import truncation

CLASSES = tuple(v.value for v in PRECEDENCE)  # the order the rules decide in (tracekit/verdicts.py)


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
    # tolerances measured for one dtype (a calibration: compare.calibrated_thresholds), applied
    # only to pairs judged on that grid, under the user's own values: ((dtype, {field: value}), ...)
    measured: tuple = ()

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
        own = next((dict(v) for d, v in self.measured if d == dtype), {})
        tol = Tol(**{**asdict(DEFAULTS[dtype]), **own, **self.given()})
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


# -- the classifier ------------------------------------------------------------------


def _take(col: np.ndarray, rows: np.ndarray, mask: np.ndarray, fill: int = -1) -> np.ndarray:
    """col[rows] where mask, else fill; safe when col is empty (every request failed)."""
    if not len(col) or not mask.any():
        return np.full(len(rows), fill, dtype=np.int64)
    return np.where(mask, col[np.where(mask, rows, 0)], fill)


EV_FLOAT = (
    "gap",
    "gap_ulp",
    "below",
    "below_ulp",
    "agree",
    "agree_tol",
    "move",
    "move_ulp",
    "prob_sum",
    "lse",
    "lse_tol",
    "col_lp",
    "max_lp",
    "unk_above",
    "dup_id",
    "dup_lp1",
    "dup_lp2",
    "topk_lp",
    "lg_mine",
    "lg_other",
)
EV_BOOL = ("greedy_ok", "tie_ok", "num_ok", "agree_ok", "move_ok", "own_in_topk", "row_ok")
EV_INT = ("top1", "row_bad")
BITS = {d.mantissa_bits: name for name, d in DTYPES.items()}


def _col(name: str, s: str) -> str:
    """Column name of an evidence float: gap_a, gap_a_ulp, below_b_ulp, agree_tol_a, move_a, ..."""
    return f"{name[:-4]}_{s}_ulp" if name.endswith("_ulp") else f"{name}_{s}"


def _empty_evidence(P: int) -> dict[str, np.ndarray]:
    ev: dict[str, np.ndarray] = {"topk_overlap": np.full(P, np.nan)}
    for s in ("a", "b"):
        ev.update({_col(n, s): np.full(P, np.nan) for n in EV_FLOAT})
        ev.update({f"{n}_{s}": np.zeros(P, bool) for n in EV_BOOL})
        ev.update({f"{n}_{s}": np.full(P, -1 if n == "top1" else 0, np.int64) for n in EV_INT})
    ev["b_in_topk_a"], ev["a_in_topk_b"] = np.zeros(P, bool), np.zeros(P, bool)
    return ev


def _refine(bits: np.ndarray, fixed: bool, rows, D: np.ndarray, note: np.ndarray, label: str) -> np.ndarray:
    """A dtype the logits refute: the divergence row's logits (top-1 and both
    candidates) must lie on the side's grid, else it is judged on the finest grid
    that holds them (said per pair). --dtype is the user's word and is kept."""
    if fixed:
        return bits
    vals = np.stack([rows.lg_top, rows.lg_mine, rows.lg_other], 1)
    out = bits.copy()
    for i in range(len(D)):
        v = vals[i][np.isfinite(vals[i])]
        if not len(v) or on_grid(v, int(bits[D[i]])).all():
            continue
        finer = next((b for b in sorted(BITS) if b > bits[D[i]] and on_grid(v, b).all()), max(BITS))
        out[D[i]] = finer
        note[D[i]] = (
            f"{label}'s logits at the difference are not on the {BITS[int(bits[D[i]])]} grid: judged on {BITS[finer]}"
        )
    return out


def classify(
    al: Alignment,
    thr: Thresholds,
    eos_ids: np.ndarray,
    dtypes: tuple[np.ndarray, np.ndarray],
    fixed: tuple[bool, bool] = (False, False),
) -> dict[str, np.ndarray]:
    """All result columns [P] except `rule` and `teacher`. dtypes: each side's
    dtype name per pair (fixed: given with --dtype); the pair is judged on the
    coarser of the two grids, after the logits at its difference had their say."""
    P = len(al.keys)
    bits_a = np.array([DTYPES[d].mantissa_bits for d in dtypes[0].tolist()], dtype=np.int64)
    bits_b = np.array([DTYPES[d].mantissa_bits for d in dtypes[1].tolist()], dtype=np.int64)
    note = np.full(P, "", dtype=object)
    t, ta, tb = first_divergence(al)
    comparable = al.incomparable == ""
    same_len = al.n_a == al.n_b
    identical = comparable & (t == al.length) & same_len
    div = comparable & (t < al.length)
    at = div | (comparable & (t == al.length) & ~same_len)  # or one side ended early
    has_a, has_b = at & (t < al.n_a), at & (t < al.n_b)
    token_a = _take(al.a.token_id, al.off_a + t, has_a)
    token_b = _take(al.b.token_id, al.off_b + t, has_b)

    # The top-k rows at the D first differences: the only top-k rows read.
    D = np.flatnonzero(div)
    ev = _empty_evidence(P)
    sides = None  # the SideRows and the top-k rows at D
    if len(D):
        rows_a, rows_b = al.off_a[D] + t[D], al.off_b[D] + t[D]
        ids_a, lps_a, lg_a = evidence.fetch_rows(al.a, rows_a)
        ids_b, lps_b, lg_b = evidence.fetch_rows(al.b, rows_b)
        ra = evidence.side_row(ids_a, lps_a, lg_a, token_a[D], token_b[D], al.a.logprob[rows_a].astype(np.float64))
        rb = evidence.side_row(ids_b, lps_b, lg_b, token_b[D], token_a[D], al.b.logprob[rows_b].astype(np.float64))
        bits_a = _refine(bits_a, fixed[0], ra, D, note, "A")
        bits_b = _refine(bits_b, fixed[1], rb, D, note, "B")
        sides = ((ra, rb), ((ids_a, lps_a, lg_a), (ids_b, lps_b, lg_b)))
    pair_bits = np.minimum(bits_a, bits_b)
    pair_dtype = np.array([BITS[int(b)] for b in pair_bits], dtype=object)
    tol = tol_columns(thr, pair_dtype)
    if len(D):
        got = evidence.measure(
            ra, rb, pair_bits[D], bits_a[D], bits_b[D], {k: v[D] for k, v in tol.items()}, thr.grid_floor
        )
        for k, v in got.items():
            ev[k][D] = v
        ev["topk_overlap"][D] = evidence.topk_overlap(ids_a, ids_b)

    # Drift before the difference, and up to (and including) A's EOS for post_eos.
    values = chosen_values(al, pair_bits)
    eos_pos = eos_before(al, ta, t, np.asarray(eos_ids, dtype=np.int64))
    main = drift(al, t, values)
    # (end 0 everywhere when no pair has an EOS: nothing to reduce, the empty result)
    sound = drift(al, np.where(eos_pos >= 0, eos_pos + 1, 0), values, skip=not (eos_pos >= 0).any())
    # Pairs measured on raw logits count steps: the nats tolerances at |logit| in [16, 32).
    per_step = np.ldexp(1.0, 4 - pair_bits)
    x = np.where(values.on_logits, tol["drift_nats"] / per_step, tol["drift_nats"])
    m = np.where(values.on_logits, tol["drift_mean_nats"] / per_step, tol["drift_mean_nats"])
    main_ok, sound_ok = drift_ok(main, x, m), drift_ok(sound, x, m)

    # vLLM's check_logprobs_close: at the first difference each token is in the
    # other's top-k; sequences equal over zip() pass. 1 pass, 0 fail, -1 n/a.
    vllm = np.where(comparable, 1, -1).astype(np.int8)
    vllm[div] = (ev["b_in_topk_a"] & ev["a_in_topk_b"])[div]

    trunc_a, trunc_b = np.full(P, "", dtype=object), np.full(P, "", dtype=object)
    refuted = np.full(P, "", dtype=object)
    for i in np.flatnonzero(comparable).tolist():
        trunc_a[i] = truncation(al.a, int(al.row_a[i]), int(al.n_a[i]), al.asked_a[i])
        trunc_b[i] = truncation(al.b, int(al.row_b[i]), int(al.n_b[i]), al.asked_b[i])
        e = int(eos_pos[i])
        if e >= 0:  # a stream that went on past the EOS without ignoring EOS refutes it
            for label, n, ask in (("A", al.n_a[i], al.asked_a[i]), ("B", al.n_b[i], al.asked_b[i])):
                if n > e + 1 and ask.ignore_eos == 0 and not refuted[i]:
                    refuted[i] = f"{label} went on past the EOS at {e} although its request did not ignore EOS"
    complete = (trunc_a == "") & (trunc_b == "")

    def both(name):
        return ev[f"{name}_a"] & ev[f"{name}_b"]

    ba, bb = _boundary(al.a, al.row_a), _boundary(al.b, al.row_b)
    valid_a, valid_b = _valid_boundary(al.a, al.row_a, ba), _valid_boundary(al.b, al.row_b, bb)
    boundary_differs = (ba >= 0) & (bb >= 0) & valid_a & valid_b & (ba != bb)
    shared = div & both("row_ok") & both("greedy_ok") & both("move_ok") & both("agree_ok") & main_ok & complete
    tie = shared & both("tie_ok")
    boundary = shared & boundary_differs & both("num_ok")
    post = at & (eos_pos >= 0) & sound_ok & complete & (refuted == "")
    # At an EOS one side emitted and llama.cpp's ignore_eos skipped (its sampler's -inf bias).
    skip = skipped_eos(al, t, (token_a, token_b), eos_ids, D, *(sides or ((), ())), ev, div & main_ok & complete)

    cls = np.full(P, "unexplained", dtype=object)
    cls[boundary] = "cache_boundary"
    cls[tie] = "bf16_tie_flip"
    cls[post | (skip.head != "")] = "post_eos"
    cls[identical & main_ok & complete] = "identical"
    cls[~comparable] = "incomparable"
    for i in np.flatnonzero(comparable & (main.n == 0) & (main.nonfinite == 0) & (t > 0)).tolist():
        note[i] = note[i] or "drift not verified: a side stored no logprob for this request"
    for i in np.flatnonzero(post & div & ~(both("num_ok") & both("move_ok"))).tolist():
        note[i] = "after the EOS the streams differ by more than numeric noise (see gaps)"
    for i in np.flatnonzero((cls == "unexplained") & (skip.why_not != "")).tolist():
        note[i] = f"{note[i]}; {skip.why_not[i]}" if note[i] else skip.why_not[i]
    return dict(
        key=al.keys,
        cls=cls,
        position=np.where(at, t, -1),
        token_a=token_a,
        token_b=token_b,
        boundary_a=ba,
        boundary_b=bb,
        boundary_valid_a=valid_a,
        boundary_valid_b=valid_b,
        prompt_len_a=_col_of(al.a, al.row_a, "prompt_len"),
        prompt_len_b=_col_of(al.b, al.row_b, "prompt_len"),
        drift_max=main.max,
        drift_mean=main.mean,
        drift_n=main.n,
        drift_on_logits=values.on_logits,
        drift_raw_max=main.raw_max,
        drift_tol=x,
        drift_mean_tol=m,
        drift_ok=main_ok,
        nonfinite=main.nonfinite,
        nonfinite_pos=main.nonfinite_pos,
        nonfinite_a=main.nonfinite_a,
        nonfinite_b=main.nonfinite_b,
        inconsistent=main.inconsistent,
        inconsistent_pos=main.inconsistent_pos,
        inconsistent_side=main.inconsistent_said[:, 0],
        inconsistent_col=main.inconsistent_said[:, 1],
        inconsistent_topk=main.inconsistent_said[:, 2],
        sound_drift_max=sound.max,
        sound_drift_n=sound.n,
        sound_drift_mean=sound.mean,
        sound_nonfinite=sound.nonfinite,
        sound_nonfinite_pos=sound.nonfinite_pos,
        sound_inconsistent=sound.inconsistent,
        sound_inconsistent_pos=sound.inconsistent_pos,
        sound_ok=sound_ok,
        bitwise=main.bitwise & comparable,
        vllm_close=vllm,
        len_a=al.n_a,
        len_b=al.n_b,
        compared=al.length,
        eos_pos=eos_pos,
        eos_id=_take(al.a.token_id, al.off_a + eos_pos, eos_pos >= 0),
        eos_known=np.full(P, len(eos_ids) > 0),
        eos_refuted=refuted,
        eos_skip=skip.head,
        eos_skipped_by=skip.by,
        incomparable=al.incomparable,
        dtype_a=np.array([BITS[int(b)] for b in bits_a], dtype=object),
        dtype_b=np.array([BITS[int(b)] for b in bits_b], dtype=object),
        dtype=pair_dtype,
        trunc_a=trunc_a,
        trunc_b=trunc_b,
        boundary_differs=boundary_differs,
        note=note,
        **{f"tol_{k}": v for k, v in tol.items()},
        **ev,
    )


def _col_of(side, rows: np.ndarray, name: str) -> np.ndarray:
    return np.where(rows >= 0, getattr(side.table, name)[np.maximum(rows, 0)], -1).astype(np.int64)


def _boundary(side, rows: np.ndarray) -> np.ndarray:
    return _col_of(side, rows, "cached_tokens")


def _valid_boundary(side, rows: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A reused prefix longer than the prompt is no boundary (an engine's report gone wrong)."""
    pl = _col_of(side, rows, "prompt_len")
    return (b < 0) | (pl <= 0) | (b <= pl)
