"""P(flip | gap): the top-2 gap at every compared position, and the run-level flip-rate test.

A flip one pair at a time can look like a tie even when the engine is broken: a batched-path
bug that moves logits by a few steps flips *more often*, and at *larger* gaps, than the
engine's healthy noise does. So the unit of evidence is the run: every compared position up
to and including each pair's first difference is a trial with a top-2 gap (A's row, the
reference side), each first difference is a flip at its gap. `tracekit calibrate` counts
trials and flips per gap bin on healthy repeats (the calibration, tracekit/calibration.py);
`flip_test` predicts the flips of a run under test from its own gaps and that calibration
and says whether the observed count is consistent with it:

    expected E = sum over the run's trial positions of p(bin of its gap)
    p(bin) ~ Beta(flips + 1/2, trials - flips + 1/2)   (Jeffreys; the calibration's own
                                                        uncertainty, drawn S times)
    observed O ~ Poisson(E_s) per draw                 (a Poisson-binomial with small p)

The p-value is P(O_pred >= O) over the draws; the interval is the 2.5-97.5 % range of
O_pred. A run whose observed flips exceed the calibrated prediction with p < `alpha` is a
finding (the cell fails) even when every pair alone is a tie. Flips at a gap above the
largest gap the calibration ever saw flip are listed by key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracekit.calibration import Calibration, GapBins

from .align import Alignment
from .grid import steps

ALPHA = 0.01  # the run-level test's significance level (docs/analysis.md)
DRAWS = 4000
SEED = 20261201  # fixed: the same inputs give the same p-value


@dataclass(frozen=True)
class PositionGaps:
    """The trials of one comparison: per trial position [M] its pair, position and gaps;
    per pair [P] whether its first difference is a flip and the gap there."""

    pair: np.ndarray  # [M] int64
    pos: np.ndarray  # [M] int64
    nats: np.ndarray  # [M] float64 top-2 logprob gap in A's row (NaN: no top-2 there)
    steps: np.ndarray | None  # [M] float64 the same gap in steps of the pair's grid (raw logits only)
    flipped: np.ndarray  # [P] bool: a first difference inside the compared length
    flip_nats: np.ndarray  # [P] float64 gap at the flip (NaN when none)
    flip_steps: np.ndarray | None


def _top2(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two largest finite values of each row [M, k] (NaN where a row has fewer than 2)."""
    v = np.where(np.isfinite(vals), vals, -np.inf).astype(np.float64)
    if v.shape[1] < 2:
        nan = np.full(len(v), np.nan)
        return nan, nan
    part = -np.partition(-v, 1, axis=1)[:, :2]
    part[~np.isfinite(part)] = np.nan
    return part[:, 0], part[:, 1]


def position_gaps(al: Alignment, t: np.ndarray, comparable: np.ndarray, bits: np.ndarray) -> PositionGaps:
    """Trials: every position p <= t of each comparable pair (p < length), gaps read from A.
    t [P]: first differing position (= length when none); bits [P]: each pair's grid."""
    end = np.where(comparable, np.minimum(t + 1, al.length), 0)
    pair = np.repeat(np.arange(len(end)), end)
    start = np.cumsum(end) - end
    pos = np.arange(int(end.sum()), dtype=np.int64) - start[pair]
    rows = al.off_a[pair] + pos
    reader = al.a.reader
    lps = reader.column("topk_logprob")
    hi, lo = _top2(lps[rows]) if len(rows) else (np.zeros(0), np.zeros(0))
    nats = hi - lo
    step_gaps = None
    if al.a.has_logits and len(rows):
        lg = reader.column("topk_logit")[rows]
        g1, g2 = _top2(lg)
        scale = np.nanmax(np.abs(np.where(np.isfinite(lg), lg, np.nan)), axis=1)
        step_gaps = np.abs(steps(g1, g2, bits[pair], scale))
    elif al.a.has_logits:
        step_gaps = np.zeros(0)
    flipped = comparable & (t < al.length)
    at_flip = flipped[pair] & (pos == t[pair])
    flip_nats = np.full(len(t), np.nan)
    flip_nats[pair[at_flip]] = nats[at_flip]
    flip_steps = None
    if step_gaps is not None:
        flip_steps = np.full(len(t), np.nan)
        flip_steps[pair[at_flip]] = step_gaps[at_flip]
    return PositionGaps(pair, pos, nats, step_gaps, flipped, flip_nats, flip_steps)


def bin_counts(gaps: np.ndarray, flips_at: np.ndarray, edges) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(trials, flips) per bin of `edges` for trial gaps [M] and flip gaps [F] (NaN dropped)."""
    e = np.asarray(edges, dtype=np.float64)
    g = gaps[np.isfinite(gaps)]
    f = flips_at[np.isfinite(flips_at)]
    trials = np.histogram(g, bins=e)[0] if len(e) > 1 else np.zeros(0)
    flips = np.histogram(f, bins=e)[0] if len(e) > 1 else np.zeros(0)
    # the last edge may be inf: np.histogram keeps it as the closed right end
    return tuple(int(x) for x in trials), tuple(int(x) for x in flips)


@dataclass(frozen=True)
class FlipTest:
    """The run-level test against one calibration: numbers inside, acts as pass/fail."""

    calibration: str  # Calibration.describe()
    unit: str  # nats | steps
    trials: int
    observed: int
    expected: float
    interval: tuple[float, float]  # 95 % prediction interval of the flip count
    p_value: float  # P(flips >= observed | calibration)
    alpha: float
    beyond: tuple[tuple[str, float], ...]  # (key, gap) of flips above the calibration's largest flip gap
    uncalibrated_bins: int  # trial positions in bins the calibration has no trials for

    @property
    def ok(self) -> bool:
        return self.p_value >= self.alpha and not self.beyond

    @property
    def inconclusive(self) -> bool:
        """Most of the run's positions lie at gaps the calibration has no trials for: the
        prediction there is the prior's (p ~ 1/2), so passing says little."""
        return self.uncalibrated_bins * 2 > self.trials

    def line(self) -> str:
        lo, hi = self.interval
        verdict = "consistent with" if self.ok else "NOT consistent with"
        if self.ok and self.inconclusive:
            verdict = "inconclusive against"
        s = (
            f"run-level flip test: {self.observed} flips observed, {self.expected:.2f} expected "
            f"(95% interval {lo:g}-{hi:g}) over {self.trials} positions, p = {self.p_value:.3g}: "
            f"{verdict} this engine's calibration {self.calibration}"
        )
        if self.beyond:
            keys = ", ".join(f"{k} ({g:.3g} {self.unit})" for k, g in self.beyond[:8])
            s += f"; flips above the largest calibrated flip gap: {keys}"
        if self.uncalibrated_bins:
            s += f"; {self.uncalibrated_bins} positions at gaps the calibration never saw (counted at p = 0.5/1)"
        return s

    def to_json(self) -> dict:
        return {
            "calibration": self.calibration,
            "unit": self.unit,
            "trials": self.trials,
            "observed": self.observed,
            "expected": round(self.expected, 6),
            "interval": list(self.interval),
            "p_value": self.p_value,
            "alpha": self.alpha,
            "beyond": [{"key": k, "gap": g} for k, g in self.beyond],
            "uncalibrated_positions": self.uncalibrated_bins,
            "inconclusive": self.inconclusive,
            "ok": self.ok,
        }


def flip_test(g: PositionGaps, keys: np.ndarray, cal: Calibration, dtype: str, alpha: float = ALPHA) -> FlipTest:
    """The run's flips against the calibration's P(flip | gap): in steps when both have raw
    logits on the same grid (`dtype`, the run's), else in nats (steps of another grid are
    not the same distance)."""
    use_steps = g.steps is not None and cal.flip_steps is not None and cal.dtype == dtype
    bins: GapBins = cal.flip_steps if use_steps else cal.flip_nats
    gaps = g.steps if use_steps else g.nats
    flip_gaps = g.flip_steps if use_steps else g.flip_nats
    gmax = cal.flip_gap_max_steps if use_steps else cal.flip_gap_max_nats
    run_trials, _ = bin_counts(gaps, flip_gaps, bins.edges)
    n = np.asarray(run_trials, dtype=np.float64)
    t, f = np.asarray(bins.trials, dtype=np.float64), np.asarray(bins.flips, dtype=np.float64)
    rng = np.random.default_rng(SEED)
    p = rng.beta(f + 0.5, t - f + 0.5, size=(DRAWS, len(t)))  # [S, bins]
    expected_s = p @ n
    pred = rng.poisson(expected_s)
    observed = int(g.flipped.sum())
    p_value = float((np.sum(pred >= observed) + 1) / (DRAWS + 1))
    lo, hi = np.percentile(pred, [2.5, 97.5])
    beyond = tuple(
        (str(keys[i]), float(flip_gaps[i]))
        for i in np.flatnonzero(g.flipped & np.isfinite(flip_gaps)).tolist()
        if flip_gaps[i] > _upper_edge(bins, gmax)
    )
    return FlipTest(
        cal.describe(),
        bins.unit,
        int(n.sum()),
        observed,
        float(expected_s.mean()),
        (float(lo), float(hi)),
        p_value,
        alpha,
        beyond,
        int(n[t == 0].sum()),
    )


def healthy_edge(cal: Calibration, use_steps: bool) -> float:
    """The largest top-2 gap this calibration accepts as a healthy flip: its largest healthy flip
    itself (the per-pair tolerances widen to the same value, compare.calibrated_thresholds). Not
    the upper edge of that flip's bin, which `flip_test` names flips `beyond`: explain excused
    prefix-key-collision flips up to that edge (2 steps where healthy flips reached 1). 0 when it
    saw no flip, or when its largest flip was an exact tie: nothing is excused then."""
    bins = cal.flip_steps if use_steps and cal.flip_steps is not None else cal.flip_nats
    if bins.total_flips == 0:
        return 0.0
    gmax = cal.flip_gap_max_steps if bins is cal.flip_steps else cal.flip_gap_max_nats
    return float(gmax) if gmax and math.isfinite(gmax) else 0.0


def _upper_edge(bins: GapBins, gmax: float | None) -> float:
    """Flips are 'beyond' the calibration above the upper edge of the bin holding its
    largest healthy flip (a bin, not the exact value: the next healthy repeat may flip a
    little higher); infinite when the calibration saw no flip at all (the count test decides)."""
    if not gmax or bins.total_flips == 0:
        return float("inf")
    e = np.asarray(bins.edges)
    i = int(np.searchsorted(e, gmax, side="right"))
    return float(e[min(i, len(e) - 1)])
