"""Distances on a run's own floating-point grid (BF16, FP16 or FP32), in steps.

A near-tie flips when two logits that differ by a few representable numbers
trade places. So the yardstick is "how many numbers of this run's grid lie
between the two values", not a magnitude formula:

- steps are counted exactly, also where two values straddle a power of two
  (BF16: 16 vs 15.5 is 8 steps: 15.5..16 is spaced 1/16, not 1/8);
- below a floor magnitude the grid is not taken finer than at the floor. The
  floor is half the row's scale (its largest logit magnitude), at least
  `floor_abs` (1.0): a logit near zero is still a sum of terms of the row's
  magnitude, so its error is set there, not at zero (0 vs -0.0078 in a row
  whose top logits are ~16 is 0.125 BF16 steps, not 256);
- FP32 runs are judged on the FP32 grid (2^16 times finer than BF16).

The dtype of a trace comes from its run record (tracekit.runrecord:
`RunRecord.dtype_claims`, in order; spellings through tracekit.dtypes.ALIASES);
`pair_grids` is the one place that decides the grids a pair (or one trace) is
judged on; when nothing names one, it says so and which grid it assumed. Pure
numpy; vectorised over rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tracekit.dtypes import DTYPES, normalise
from tracekit.errors import ConfigError
from tracekit.runrecord import LABEL_CLAIM, RunRecord

__all__ = ["Grid", "PairGrids", "normalise", "pair_grids", "resolve_dtype", "steps", "on_grid"]

ASSUMED = "bf16"  # the grid used when nothing names one (said in every output)
FLOOR_ABS = 1.0  # the grid is never finer than at |x| = 1.0 (see module docstring)


@dataclass(frozen=True)
class Grid:
    """The dtype a trace is judged on and where that came from."""

    dtype: str  # fp32 | bf16 | fp16
    source: str  # e.g. "engine self-report (dtype)", "assumed: no dtype in the run metadata"
    known: bool

    @property
    def bits(self) -> int:
        return DTYPES[self.dtype].mantissa_bits

    def describe(self) -> str:
        return f"{self.dtype} ({self.source})"


def _record(run: RunRecord | Mapping) -> RunRecord:
    return run if isinstance(run, RunRecord) else RunRecord.from_json(run)


def resolve_dtype(run: RunRecord | Mapping, override: str | None = None) -> tuple[Grid, str | None]:
    """(grid, conflict note or None) for one trace's run record. `override`
    (diff --dtype) wins; otherwise the first of the record's dtype claims
    (RunRecord.dtype_claims: the engine's self-report, then the capture's label)."""
    if override:
        d = normalise(override)
        if d is None:
            raise ConfigError(f"--dtype {override!r}: expected one of {', '.join(DTYPES)}")
        return Grid(d, "--dtype", True), None
    rec = _record(run)
    found = rec.dtype_claims()
    if not found:
        src = rec.dtype.source or ""
        if src.startswith("quantized"):  # no float grid at all: steps are only a yardstick of last resort
            return Grid(ASSUMED, f"assumed for lack of a grid; {src}", False), None
        return Grid(ASSUMED, "assumed: the run metadata names no dtype; pass --dtype to set it", False), None
    named = sorted({d for _, d in found}, key=lambda d: DTYPES[d].mantissa_bits)
    d = named[-1]  # names that disagree: the finest grid (the strictest judge) until one is proven
    src = next(s for s, dd in found if dd == d)
    if src == LABEL_CLAIM and rec.dtype.source:
        src = f"run metadata dtype ({rec.dtype.source})"
    if len(named) == 1:
        return Grid(d, src, True), None
    said = "; ".join(f"{s} says {dd}" for s, dd in found)
    return Grid(d, src, True), f"the run metadata names several dtypes ({said}): judged on the finest, {d}"


def finest_holding(x: np.ndarray) -> str:
    """The coarsest of BF16, FP16 whose grid holds every value of x, else fp32."""
    return next((d for d in ("bf16", "fp16") if on_grid(x, DTYPES[d].mantissa_bits).all()), "fp32")


def _checked(grid: Grid, x: np.ndarray | None) -> tuple[Grid, list[str]]:
    """A named grid checked against raw logits the trace holds (x: a sample): logits off the named
    grid refute it; with no name the logits decide."""
    if x is None or not len(x):
        return grid, []
    holds = finest_holding(x)
    if not grid.known:
        if holds == "fp32":
            return Grid("fp32", "inferred: the raw logits are not on the BF16 or FP16 grid", False), []
        return Grid(holds, f"inferred: {len(x)} sampled raw logits lie on the {holds.upper()} grid", False), []
    if DTYPES[holds].mantissa_bits > grid.bits:
        note = (
            f"the run metadata says {grid.dtype} but its raw logits are not on that grid: judged on {holds} "
            f"(pass --dtype {grid.dtype} if the logits are post-processed, e.g. soft-capped)"
        )
        return Grid(holds, f"{grid.source}, refuted by the raw logits", True), [note]
    return grid, []


@dataclass(frozen=True)
class PairGrids:
    """The grids a pair of traces is judged on (b None: one trace alone), with notes per side
    (unlabelled: the conflict of the run record's names first, then the logits' refutation)."""

    a: Grid
    b: Grid | None
    notes: tuple[tuple[str, ...], tuple[str, ...]]


def _one(run: RunRecord | Mapping, override: str | None, x: np.ndarray | None) -> tuple[Grid, list[str]]:
    grid, conflict = resolve_dtype(run, override)
    notes = [conflict] if conflict else []
    if override:
        return grid, notes
    grid, more = _checked(grid, x)
    return grid, notes + more


def pair_grids(
    a: RunRecord | Mapping,
    b: RunRecord | Mapping | None = None,
    override: str | None = None,
    logits: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> PairGrids:
    """The one decision of which grid each side is judged on: --dtype wins; else each run record's
    dtype claims, checked against the side's sampled raw `logits` (when given); a side whose
    dtype is only assumed (not inferred) takes the other side's known one: never judge a known
    FP32 trace on an assumed, coarser grid."""
    ga, na = _one(a, override, logits[0])
    if b is None:
        return PairGrids(ga, None, (tuple(na), ()))
    gb, nb = _one(b, override, logits[1])
    if not ga.known and gb.known and not ga.source.startswith("inferred"):
        ga = Grid(gb.dtype, f"assumed like B ({gb.describe()}); A names none", False)
    if not gb.known and ga.known and not gb.source.startswith("inferred"):
        gb = Grid(ga.dtype, f"assumed like A ({ga.describe()}); B names none", False)
    return PairGrids(ga, gb, (tuple(na), tuple(nb)))


def spacing(x: np.ndarray, bits: int | np.ndarray) -> np.ndarray:
    """Distance between neighbouring numbers of the grid at magnitude |x| (normal range)."""
    _, e = np.frexp(np.abs(np.asarray(x, dtype=np.float64)))
    return np.ldexp(1.0, e - 1 - np.asarray(bits))


def floor_magnitude(scale: np.ndarray, floor_abs: float = FLOOR_ABS) -> np.ndarray:
    """The magnitude below which the grid is not refined: half the row's scale, >= floor_abs."""
    return np.maximum(np.abs(np.asarray(scale, dtype=np.float64)) / 2, floor_abs)


def ordinal(v: np.ndarray, bits: int | np.ndarray, floor_mag: np.ndarray) -> np.ndarray:
    """A signed position of v on the grid, in steps, with the grid taken no finer
    than at `floor_mag`: exact counts between grid points (also across powers of
    two), continuous between them. NaN where v is not finite.

    With m = bits and e_f = floor(log2 floor_mag): below 2^(e_f+1) every step is
    2^(e_f-m) wide, so H(a) = a / 2^(e_f-m); above, each binade [2^e, 2^(e+1))
    holds 2^m steps, so H(a) = 2^m * (e_a - e_f + a / 2^e_a)."""
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(bits, dtype=np.float64)
    a = np.abs(v)
    _, ef1 = np.frexp(np.asarray(floor_mag, dtype=np.float64))  # floor_mag = f * 2^ef1, f in [0.5, 1)
    e_f = ef1 - 1
    fa, ea1 = np.frexp(a)
    e_a = ea1 - 1
    low = a < np.ldexp(1.0, e_f + 1)
    h = np.where(low, a * np.exp2(m - e_f), np.exp2(m) * (e_a - e_f + 2 * fa))
    h = np.where(np.isfinite(v), h, np.nan)
    return np.sign(v) * h


def steps(x: np.ndarray, y: np.ndarray, bits: int | np.ndarray, scale: np.ndarray, floor_abs: float = FLOOR_ABS):
    """x - y in steps of the grid (signed), the grid floored by the row's `scale`."""
    fm = floor_magnitude(scale, floor_abs)
    return ordinal(x, bits, fm) - ordinal(y, bits, fm)


def on_grid(x: np.ndarray, bits: int) -> np.ndarray:
    """Whether each finite value is exactly representable with `bits` significand bits."""
    x = np.asarray(x, dtype=np.float64)
    f, _ = np.frexp(x)
    scaled = np.ldexp(f, bits + 1)
    return np.isfinite(x) & (scaled == np.round(scaled))
