"""How the rule texts write numbers: distances in steps or nats, tolerances, drift.

Formatting only, shared by the checks' reasons (checks.py) and the benign texts (rules.py).
"""

from __future__ import annotations

import math

import numpy as np

from .facts import Facts
from .positions import Drift


def num(x: float, fmt: str = ".3g") -> str:
    x = float(x)
    return format(x, fmt) if math.isfinite(x) else "?"


def signed(x: float) -> str:
    return f"{float(x):+.3g}" if np.isfinite(x) else "?"


def dist(nats: float, ulp: float, is_signed: bool = False) -> str:
    """A distance measured in steps when raw logits gave it, else in nats."""
    fmt = signed if is_signed else (lambda x: num(abs(x)))
    return f"{fmt(ulp)} ulp" if np.isfinite(ulp) else f"{fmt(nats)} nats"


def tol(f: Facts, i: int, kind: str, ulp: float) -> str:
    """The tolerance `kind` (tie|drift) in the unit a distance was measured in (steps when `ulp`
    is finite, else nats)."""
    if np.isfinite(ulp):
        return f"{f.tol[f'{kind}_ulps'][i]:g} ulp"
    return f"{f.tol[f'{kind}_nats'][i]:g} nats"


def drift_unit(f: Facts, i: int) -> str:
    return "ulp" if f.on_logits[i] else "nats"


def mean_bound(f: Facts, i: int, n: int) -> float:
    x, m = f.drift_tol[i], f.drift_mean_tol[i]
    return m + (x - m) / max(n, 1)


def drift_text(f: Facts, d: Drift, i: int) -> str:
    """'drift max 0.052 / mean 0.0081 nats over 25 positions <= 0.5 / 0.08' (benign form)."""
    return drift_words(d.max[i], d.mean[i], int(d.n[i]), bool(f.on_logits[i]), f.drift_tol[i], f.drift_mean_tol[i])


def drift_words(mx: float, mean: float, n: int, on_logits: bool, x: float, m: float) -> str:
    """drift_text from its numbers: max, mean, positions, on raw logits, the max and mean bounds
    (rules.rule_texts words every identical pair from its columns as lists)."""
    if not math.isfinite(mx):
        return "no logprob to compare before it" if not n else "drift ?"
    on = " (raw logits)" if on_logits else ""
    unit = "ulp" if on_logits else "nats"
    bound = m + (x - m) / max(n, 1)  # mean_bound
    return f"drift{on} max {num(mx)} / mean {num(mean)} {unit} over {n} positions <= {float(x):g} / {num(bound)}"


def drift_failures(f: Facts, d: Drift, i: int, where: str = "before the flip") -> list[str]:
    """What is wrong with the drift `d` (f.main, or f.sound up to A's EOS) of pair i."""
    out = []
    main = d is f.main  # the first values and the raw move are quoted for the main drift only
    at = f" {where}" if where else ""
    nf, pos = int(d.nonfinite[i]), int(d.nonfinite_pos[i])
    if nf:
        seen = f" (A {d.nonfinite_a[i]:.4g} vs B {d.nonfinite_b[i]:.4g})" if main else ""
        out.append(f"a logprob is NaN/inf on one side only at {nf} position(s){at}, first at {pos}{seen}")
    inc = int(d.inconsistent[i])
    if inc:
        first = f"first at {int(d.inconsistent_pos[i])}"
        side, col, row = d.inconsistent_said[i]
        if main and np.isfinite(side):
            first += f": {'AB'[int(side)]}'s column {num(col)}, its top-k row {num(row)} nats"
        out.append(f"a logprob column contradicts the same token's top-k entry at {inc} position(s){at}, {first}")
    mx, mean, n = d.max[i], d.mean[i], int(d.n[i])
    u, what = drift_unit(f, i), ("raw logits" if f.on_logits[i] else "logprobs")
    if np.isfinite(mx) and mx > f.drift_tol[i]:
        raw = f" (a logit moved by {num(d.raw_max[i])})" if f.on_logits[i] and main else ""
        out.append(f"{what} drift {num(mx)} {u}{at}{raw} > {f.drift_tol[i]:g} ({f.dtype[i]})")
    elif np.isfinite(mean) and mean > mean_bound(f, i, n):
        out.append(
            f"mean drift {num(mean)} {u} over {n} positions{at} > {num(mean_bound(f, i, n))} "
            f"({f.dtype[i]}: {f.drift_mean_tol[i]:g} + ({f.drift_tol[i]:g} - "
            f"{f.drift_mean_tol[i]:g}) / {n})"
        )
    return out
