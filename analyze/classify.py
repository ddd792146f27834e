"""Classify every aligned pair by the divergence taxonomy, vectorised.

`facts()` measures every number a verdict rests on into facts.Facts (one
SideEvidence per side); checks.py's table of named checks judges them (the
verdict: the first class whose checks all pass); rules.py words the verdict
(an `unexplained` text is the failed checks' reasons). All per-position work
runs on the concatenated rows of every pair [T] with numpy; Python touches each
pair at most once (to format its rule text). Top-k rows are read only at the D
divergence positions (evidence.py). A benign class is a claim, and every part
of it is checked (docs/analysis.md):

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

from . import checks, evidence
from .align import Alignment
from .eos_policy import skipped_eos
from .facts import FLIP, LENGTH, NONE, SAME, Facts, columns, side_evidence
from .grid import FLOOR_ABS, on_grid
from .positions import chosen_values, drift, eos_before, first_divergence
from .rules import rule_texts
from .streams import complete, truncation

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
    # the healthy top-2 gap move of one dtype (a calibration's gap_move, compare.calibrated_thresholds):
    # a flip whose total move, A's gap + B's gap, lies within it is a tie: ((dtype, steps, nats), ...)
    tie_move: tuple = ()

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
    out = {f: np.array([getattr(per[d], f) for d in dtypes.tolist()], dtype=np.float64) for f in OPTIONS}
    move = {d: (u, n) for d, u, n in thr.tie_move}  # 0: no gap-move tie (uncalibrated)
    out["tie_move_ulps"] = np.array([move.get(d, (0.0, 0.0))[0] for d in dtypes.tolist()], dtype=np.float64)
    out["tie_move_nats"] = np.array([move.get(d, (0.0, 0.0))[1] for d in dtypes.tolist()], dtype=np.float64)
    return out


# -- the classifier ------------------------------------------------------------------


def _take(col: np.ndarray, rows: np.ndarray, mask: np.ndarray, fill: int = -1) -> np.ndarray:
    """col[rows] where mask, else fill; safe when col is empty (every request failed)."""
    if not len(col) or not mask.any():
        return np.full(len(rows), fill, dtype=np.int64)
    return np.where(mask, col[np.where(mask, rows, 0)], fill)


BITS = {d.mantissa_bits: name for name, d in DTYPES.items()}


def _refine(bits: np.ndarray, fixed: bool, rows, D: np.ndarray, note: np.ndarray, label: str) -> np.ndarray:
    """A dtype the logits refute: the divergence row's logits (top-1 and both
    candidates) must lie on the side's grid, else it is judged on the finest grid
    that holds them (said per pair). --dtype is the user's word and is kept."""
    if fixed:
        return bits
    vals = np.stack([rows.lg_top, rows.lg_mine, rows.lg_other], 1)
    out = bits.copy()
    fin = np.isfinite(vals)
    fits = (on_grid(vals, bits[D][:, None]) | ~fin).all(1)  # every finite value on its grid: kept
    for i in np.flatnonzero(~fits).tolist():  # the rest, one at a time (rare)
        v = vals[i][fin[i]]
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
    """All result columns [P] except `teacher`. dtypes: each side's dtype name per pair
    (fixed: given with --dtype); the pair is judged on the coarser of the two grids,
    after the logits at its difference had their say."""
    f = facts(al, thr, eos_ids, dtypes, fixed)
    j = checks.judge(f)
    numeric = checks.num_ok(f, f.a) & checks.num_ok(f, f.b) & checks.move_ok(f, f.a) & checks.move_ok(f, f.b)
    for i in np.flatnonzero(j.holds["post_eos"] & (f.kind == FLIP) & ~numeric).tolist():
        f.note[i] = "after the EOS the streams differ by more than numeric noise (see gaps)"
    for i in np.flatnonzero((j.cls == "unexplained") & (f.eos_skip.why_not != "")).tolist():
        f.note[i] = f"{f.note[i]}; {f.eos_skip.why_not[i]}" if f.note[i] else f.eos_skip.why_not[i]
    cols = columns(f, checks.side_flags(f))
    cols.update(
        cls=j.cls,
        drift_ok=j.ok["drift"],
        sound_ok=j.ok["sound_drift"],
        rule=rule_texts(f, j),
    )
    return cols


def facts(
    al: Alignment,
    thr: Thresholds,
    eos_ids: np.ndarray,
    dtypes: tuple[np.ndarray, np.ndarray],
    fixed: tuple[bool, bool] = (False, False),
) -> Facts:
    """Measure every number the checks read (facts.Facts), vectorised over the pairs."""
    P = len(al.keys)
    bits_a = np.array([DTYPES[d].mantissa_bits for d in dtypes[0].tolist()], dtype=np.int64)
    bits_b = np.array([DTYPES[d].mantissa_bits for d in dtypes[1].tolist()], dtype=np.int64)
    note = np.full(P, "", dtype=object)
    t, ta, tb = first_divergence(al)
    comparable = al.incomparable == ""
    same_len = al.n_a == al.n_b
    kind = np.full(P, NONE, np.int8)
    kind[comparable & (t == al.length) & same_len] = SAME
    kind[comparable & (t == al.length) & ~same_len] = LENGTH  # identical up to where one side ended
    kind[comparable & (t < al.length)] = FLIP
    at = (kind == FLIP) | (kind == LENGTH)
    token_a = _take(al.a.token_id, al.off_a + t, at & (t < al.n_a))
    token_b = _take(al.b.token_id, al.off_b + t, at & (t < al.n_b))

    # The top-k rows at the D first differences: the only top-k rows read.
    D = np.flatnonzero(kind == FLIP)
    rows, tops = ((), ()), ((), ())
    if len(D):
        rows_a, rows_b = al.off_a[D] + t[D], al.off_b[D] + t[D]
        top_a, top_b = evidence.fetch_rows(al.a, rows_a), evidence.fetch_rows(al.b, rows_b)
        ra = evidence.side_row(*top_a, token_a[D], token_b[D], al.a.logprob[rows_a].astype(np.float64))
        rb = evidence.side_row(*top_b, token_b[D], token_a[D], al.b.logprob[rows_b].astype(np.float64))
        bits_a = _refine(bits_a, fixed[0], ra, D, note, "A")
        bits_b = _refine(bits_b, fixed[1], rb, D, note, "B")
        rows, tops = (ra, rb), (top_a, top_b)
    pair_bits = np.minimum(bits_a, bits_b)
    pair_dtype = np.array([BITS[int(b)] for b in pair_bits], dtype=object)
    tol = tol_columns(thr, pair_dtype)
    measured: tuple[dict, dict] = ({}, {})
    overlap = np.full(P, np.nan)
    if len(D):
        measured = evidence.measure(
            *rows, pair_bits[D], bits_a[D], bits_b[D], {k: v[D] for k, v in tol.items()}, thr.grid_floor
        )
        overlap[D] = evidence.topk_overlap(tops[0][0], tops[1][0])

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

    trunc_a, trunc_b, refuted = _streams(al, comparable, eos_pos)
    ba, bb = _boundary(al.a, al.row_a), _boundary(al.b, al.row_b)
    valid_a, valid_b = _valid_boundary(al.a, al.row_a, ba), _valid_boundary(al.b, al.row_b, bb)
    bits_name = (
        np.array([BITS[int(b)] for b in bits_a], dtype=object),
        np.array([BITS[int(b)] for b in bits_b], dtype=object),
    )
    side = [
        side_evidence(
            dict(
                token=tok,
                n=n,
                trunc=tr,
                boundary=bd,
                boundary_valid=ok,
                prompt_len=_col_of(s, r, "prompt_len"),
                dtype=dt,
            ),
            got,
            D,
        )
        for tok, n, tr, bd, ok, s, r, dt, got in (
            (token_a, al.n_a, trunc_a, ba, valid_a, al.a, al.row_a, bits_name[0], measured[0]),
            (token_b, al.n_b, trunc_b, bb, valid_b, al.b, al.row_b, bits_name[1], measured[1]),
        )
    ]
    f = Facts(
        key=al.keys,
        incomparable=al.incomparable,
        kind=kind,
        position=np.where(at, t, -1),
        compared=al.length,
        a=side[0],
        b=side[1],
        topk_overlap=overlap,
        dtype=pair_dtype,
        tol=tol,
        main=main,
        sound=sound,
        on_logits=values.on_logits,
        drift_tol=x,
        drift_mean_tol=m,
        eos_pos=eos_pos,
        eos_id=_take(al.a.token_id, al.off_a + eos_pos, eos_pos >= 0),
        eos_known=np.full(P, len(eos_ids) > 0),
        eos_refuted=refuted,
        eos_skip=None,
        boundary_differs=(ba >= 0) & (bb >= 0) & valid_a & valid_b & (ba != bb),
        vllm_close=np.where(comparable, 1, -1).astype(np.int8),
        note=note,
    )
    # vLLM's check_logprobs_close: at the first difference each token is in the
    # other's top-k; sequences equal over zip() pass. 1 pass, 0 fail, -1 n/a.
    f.vllm_close[D] = checks.both_in_topk(f)[D]
    # At an EOS one side emitted and llama.cpp's ignore_eos skipped (its sampler's -inf bias).
    f.eos_skip = skipped_eos(al, t, (token_a, token_b), eos_ids, D, rows, tops, f, _skip_sound(f))
    for i in np.flatnonzero(comparable & (main.n == 0) & (main.nonfinite == 0) & (t > 0)).tolist():
        note[i] = note[i] or "drift not verified: a side stored no logprob for this request"
    return f


def _skip_sound(f: Facts) -> np.ndarray:
    """[P] what a skipped EOS rests on besides its own rule: drift before it, complete streams,
    sane rows whose logits and logprobs agree, both candidates moved within tolerance."""
    ok = checks.main_drift_ok(f) & (f.a.trunc == "") & (f.b.trunc == "") & (f.kind == FLIP)
    for s in (f.a, f.b):
        ok &= checks.row_ok(f, s) & checks.agree_ok(f, s) & checks.move_ok(f, s)
    return ok


def _streams(al: Alignment, comparable: np.ndarray, eos_pos: np.ndarray):
    """Per pair [P]: each side's truncation ('' when complete) and why A's EOS is refuted ('')."""
    P = len(al.keys)
    trunc_a, trunc_b = np.full(P, "", dtype=object), np.full(P, "", dtype=object)
    refuted = np.full(P, "", dtype=object)
    for out, side, rows, n, ask in (
        (trunc_a, al.a, al.row_a, al.n_a, al.asked_a),
        (trunc_b, al.b, al.row_b, al.n_b, al.asked_b),
    ):
        cand = np.flatnonzero(comparable)
        done = complete(side, rows[cand], n[cand], [ask[i] for i in cand.tolist()])
        for i in cand[~done].tolist():
            out[i] = truncation(side, int(rows[i]), int(n[i]), ask[i])
    for i in np.flatnonzero(comparable & (eos_pos >= 0)).tolist():
        e = int(eos_pos[i])  # a stream that went on past the EOS without ignoring EOS refutes it
        for label, n, ask in (("A", al.n_a[i], al.asked_a[i]), ("B", al.n_b[i], al.asked_b[i])):
            if n > e + 1 and ask.ignore_eos == 0 and not refuted[i]:
                refuted[i] = f"{label} went on past the EOS at {e} although its request did not ignore EOS"
    return trunc_a, trunc_b, refuted


def _col_of(side, rows: np.ndarray, name: str) -> np.ndarray:
    return np.where(rows >= 0, getattr(side.table, name)[np.maximum(rows, 0)], -1).astype(np.int64)


def _boundary(side, rows: np.ndarray) -> np.ndarray:
    return _col_of(side, rows, "cached_tokens")


def _valid_boundary(side, rows: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A reused prefix longer than the prompt is no boundary (an engine's report gone wrong)."""
    pl = _col_of(side, rows, "prompt_len")
    return (b < 0) | (pl <= 0) | (b <= pl)
