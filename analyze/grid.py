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

The dtype of a trace comes from its run metadata (docs/analysis.md lists the
keys, in order); when none names one, `resolve_dtype` says so and which grid it
assumed. Pure numpy; vectorised over rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from tracekit.dtypes import DTYPES

# Names engines and tools use for the three formats, normalised to tracekit's.
ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
}
ASSUMED = "bf16"  # the grid used when nothing names one (said in every output)
FLOOR_ABS = 1.0  # the grid is never finer than at |x| = 1.0 (see module docstring)

# Where a run's dtype is read, best first: the engine's self-report of its logits'
# dtype, its model dtype (tracekit serve's /v1/models meta; TGI /info; SGLang
# server info), then the capture's label (--run-meta dtype=..., the matrix cell).
DTYPE_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine self-report (logits_dtype)", ("engine", "v1_models", "meta", "logits_dtype")),
    ("engine self-report (dtype)", ("engine", "v1_models", "meta", "dtype")),
    ("engine self-report (TGI model_dtype)", ("engine", "info", "model_dtype")),
    ("engine self-report (SGLang dtype)", ("engine", "server_info", "dtype")),
    ("engine self-report (SGLang dtype)", ("engine", "model_info", "dtype")),
    ("capture label (run dtype)", ("dtype",)),
)


def normalise(name: Any) -> str | None:
    """'torch.bfloat16' / 'BF16' / 'bfloat16' -> 'bf16'; None for anything else ('auto', '')."""
    if not isinstance(name, str):
        return None
    s = name.strip().lower().removeprefix("torch.")
    return ALIASES.get(s)


def _dig(run: Mapping, path: tuple[str, ...]) -> Any:
    x: Any = run
    for k in path:
        if not isinstance(x, Mapping):
            return None
        x = x.get(k)
    return x


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


def resolve_dtype(run: Mapping, override: str | None = None) -> tuple[Grid, str | None]:
    """(grid, conflict note or None) for one trace's run metadata. `override`
    (diff --dtype) wins; otherwise the first key of DTYPE_KEYS that names a dtype."""
    if override:
        d = normalise(override)
        if d is None:
            from tracekit.errors import ConfigError

            raise ConfigError(f"--dtype {override!r}: expected one of {', '.join(DTYPES)}")
        return Grid(d, "--dtype", True), None
    found = [(src, normalise(_dig(run, path))) for src, path in DTYPE_KEYS]
    found = [(s, d) for s, d in found if d]
    if not found:
        return Grid(ASSUMED, "assumed: the run metadata names no dtype; pass --dtype to set it", False), None
    named = sorted({d for _, d in found}, key=lambda d: DTYPES[d].mantissa_bits)
    d = named[-1]  # names that disagree: the finest grid (the strictest judge) until one is proven
    src = next(s for s, dd in found if dd == d)
    if src.startswith("capture label") and isinstance(run.get("dtype_source"), str):
        src = f"run metadata dtype ({run['dtype_source']})"
    if len(named) == 1:
        return Grid(d, src, True), None
    said = "; ".join(f"{s} says {dd}" for s, dd in found)
    return Grid(d, src, True), f"the run metadata names several dtypes ({said}): judged on the finest, {d}"


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
