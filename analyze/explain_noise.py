"""explain's yardstick from a calibration of the engine under test (`tracekit calibrate`).

- `numeric_bound`: a run that gave B's token is numeric when its drift before t, and its A/B gap
  at t, stay within twice the largest of the calibration's healthy drift and flip gap (the gap at
  t may also reach the healthy top-2 gap move: explain.explain passes it to the Scorer).
- `within_noise`: a pair that the not-reproduced `bug` or `unresolved` rule would name, whose
  class is benign and whose runs show no different computation (no run gave B's token
  non-numerically or left A's tokens before t other than at a near-tie within the same bounds: a
  burst's other batch mates can tip an earlier tie), is `calibrated_noise` when its flip lies within
  this engine's healthy noise: A's top-2 gap at t at most the largest gap a healthy repeat
  flipped at (that flip itself, flip_rate.healthy_edge), or A's + B's gap within the healthy
  top-2 gap move (the per-pair tie's rule, compare._tie_move). The batched-path-error `bug`
  (measured against the FP32 reference) is never excused; a calibration that saw no healthy
  flip, or whose largest was an exact tie, excuses nothing by the flip rule.
"""

from __future__ import annotations

import numpy as np

from tracekit.verdicts import BENIGN as _BENIGN

BENIGN = tuple(v.value for v in _BENIGN)


def numeric_bound(cal) -> float:
    """The calibrated numeric bound (nats): twice the largest healthy drift or flip gap."""
    drift = float(cal.drift_max_nats.get("p100", 0.0) or 0.0)
    return max(2.0 * max(drift, cal.flip_gap_max_nats), 1e-6)


def within_noise(p: dict, cal, counts: dict) -> str | None:
    """With a calibration: the phrase saying that this benign pair's flip lies within the engine's
    measured healthy flips (see the module docstring), or None. Never when a run shows a different
    computation: B's token back but not numerically, or A's tokens left before t by a jump (not at a
    near-tie within the numeric bounds)."""
    from .flip_rate import healthy_edge

    if cal is None or p.get("class") not in BENIGN:
        return None
    # the engine under test's own runs: its FP32 configuration leaves BF16 A's tokens by design
    if any(c.b > c.b_numeric or c.early > c.early_numeric for c in counts.values() if c.config == "engine"):
        return None
    steps = cal.flip_steps is not None and p.get("gap_a_ulp") is not None and p.get("dtype_a") == cal.dtype
    gap = p.get("gap_a_ulp") if steps else p.get("gap_a")
    edge = healthy_edge(cal, steps)
    unit = "steps" if steps else "nats"
    if gap is not None and edge > 0 and gap <= edge:
        pass
    elif (moved := _within_gap_move(p, cal, steps)) is not None:
        return moved
    else:
        return None
    bound = f"up to {edge:.3g} {unit}, its largest healthy flip"
    return (
        f"A's top-2 gap at t {gap:.3g} {unit}, within the healthy flips of calibration {cal.name} "
        f"({bound}; {cal.flip_nats.total_flips} flips in {cal.pairs} healthy pairs)"
    )


def _within_gap_move(p: dict, cal, steps: bool) -> str | None:
    """The phrase when A's + B's gap at t (how far the top-2 gap moved between A and B) lies within
    this engine's largest healthy top-2 gap move (calibrate's `gap_move`, the same rule the
    per-pair tie uses: compare._tie_move), else None."""
    gm = cal.gap_move_max
    if gm is None:
        return None
    bound = gm[1] if steps else gm[0]
    ga, gb = (p.get("gap_a_ulp"), p.get("gap_b_ulp")) if steps else (p.get("gap_a"), p.get("gap_b"))
    if bound is None or ga is None or gb is None or not (ga + gb <= bound):
        return None
    unit = "steps" if steps else "nats"
    return (
        f"A's + B's top-2 gap at t {ga:.3g} + {gb:.3g} = {ga + gb:.3g} {unit}, within the healthy top-2 gap "
        f"move of calibration {cal.name} (up to {bound:.3g} {unit}, p100 over {cal.gap_move.get('n', 0)} positions)"
    )


def run_finding(res) -> str | None:
    """The run-level finding of a diff judged on this engine's calibration (and reference), in one
    phrase, or None when the run passes: its flips more frequent, or at larger gaps, than the
    calibration predicts (flip_rate.FlipTest), or B farther from the reference across the run
    (reference.run_test), or some pairs of the run with B farther from it one at a time (a fault
    that touches only the padded rows of a batch dilutes the run's median, not those pairs). One
    pair at a time a batched-path bug looks like a healthy tie flip (a burst reproduces it, alone
    does not); across the run it does not, and that is what explain then reports for every pair it
    would have called benign."""
    parts = []
    t = getattr(res, "flip_test", None)
    if t is not None and not t.ok:
        lo, hi = t.interval
        parts.append(
            f"{t.observed} flips where this engine's calibration predicts {t.expected:.2f} (95% interval "
            f"{lo:g}-{hi:g}, p = {t.p_value:.3g}"
            + (f"; {len(t.beyond)} above its largest healthy flip gap" if t.beyond else "")
            + ")"
        )
    r = getattr(res, "reference", None)
    if r is not None and r.run_verdict == "B farther across the run":
        parts.append(
            f"B farther from the reference across the run (median B/A {r.run_median_ratio:.3g} over "
            f"{r.run_pairs} pairs, Wilcoxon p = {r.run_p_b:.3g})"
        )
    if r is not None and (far := np.flatnonzero(np.asarray(r.verdict) == "B farther")).size:
        keys = res.columns["key"]
        lo = float(np.nanmin(np.asarray(r.ratio_lo)[far]))
        named = ", ".join(str(keys[i]) for i in far[:6].tolist()) + ("..." if far.size > 6 else "")
        parts.append(
            f"{far.size} pair(s) of the run with B farther from the reference one at a time (B/A 95% CI lower "
            f"bounds >= {lo:.3g}: {named})"
        )
    return "; ".join(parts) or None
