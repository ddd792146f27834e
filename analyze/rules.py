"""The rule text of every verdict: why pair i got its class, with the numbers.

A benign text states each part of the claim with its numbers and tolerance; an
`unexplained` text is the reasons of every check that failed (checks.py: "B chose
token 9, 11.1 nats below its own top-1 5"; "same 6 token ids, but logprobs drift
5.99 nats"). Formatting only: the decisions are made by the check table.
"""

from __future__ import annotations

import numpy as np

from .checks import Judged, failures, move_text, tie_ok
from .facts import FLIP, Facts
from .wording import dist, drift_text, drift_words, tol


def rule_text(f: Facts, j: Judged, i: int) -> str:
    """Why pair i got its class, with the numbers that decided it."""
    cls = j.cls[i]
    if cls == "incomparable":
        return f.incomparable[i]
    if cls == "identical":
        return _identical(f, i)
    if cls == "post_eos" and f.eos_skip.head[i]:
        return _eos_skipped(f, i)
    if cls == "post_eos":
        return (
            f"A emitted EOS (id {f.eos_id[i]}) at {f.eos_pos[i]} before the first "
            f"difference at {f.position[i]}; up to the EOS: {drift_text(f, f.sound, i)}; both streams complete"
            + (f"; note: {f.note[i]}" if f.note[i] else "")
        )
    if cls in ("bf16_tie_flip", "cache_boundary"):
        return _benign_flip(f, i, cls)
    out = failures(f, j, i)
    if f.kind[i] == FLIP and f.note[i]:
        out.append(f"note: {f.note[i]}")
    return "; ".join(out) or "no benign rule applies"


def rule_texts(f: Facts, j: Judged) -> np.ndarray:
    """[P] object: rule_text of every pair. The identical pairs (most of a run) are worded from
    their columns as lists, at once; the rest one by one (tests/analyze/test_vectorised.py: the same texts)."""
    out = np.empty(len(f.key), dtype=object)
    same = np.flatnonzero(j.cls == "identical")
    d = f.main
    cols = (f.compared, d.bitwise, d.n, d.max, d.mean, f.on_logits, f.drift_tol, f.drift_mean_tol, f.dtype)
    for i, *x in zip(same.tolist(), *(c[same].tolist() for c in cols)):
        out[i] = _identical_words(*x)
    for i in np.flatnonzero(j.cls != "identical").tolist():
        out[i] = rule_text(f, j, i)
    return out


def _identical_words(compared, bitwise, n, mx, mean, on_logits, x, m, dtype) -> str:
    if bitwise:
        tail = "chosen logprobs bitwise equal"
    elif n == 0:
        tail = "drift not verified: a side stored no logprobs"
    else:
        tail = drift_words(mx, mean, n, on_logits, x, m)
    return f"same {compared} token ids; {tail} ({dtype}); both streams complete"


def _identical(f: Facts, i: int) -> str:
    if f.main.bitwise[i]:
        tail = "chosen logprobs bitwise equal"
    elif f.main.n[i] == 0:
        tail = "drift not verified: a side stored no logprobs"
    else:
        tail = drift_text(f, f.main, i)
    return f"same {f.compared[i]} token ids; {tail} ({f.dtype[i]}); both streams complete"


def _moved(f: Facts, i: int) -> str:
    a, b = f.a, f.b
    return (
        f"moved A->B: token {a.token[i]} {dist(a.move[i], a.move_ulp[i], True)}, token {b.token[i]} "
        f"{dist(b.move[i], b.move_ulp[i], True)} <= {tol(f, i, 'drift', a.move_ulp[i])}"
    )


def _eos_skipped(f: Facts, i: int) -> str:
    """At an EOS one side emitted and llama.cpp's ignore_eos skipped (eos_policy.skipped_eos)."""
    by = f.eos_skip.by[i]
    s = f.a if by == "A" else f.b
    return (
        f"{f.eos_skip.head[i]}: {by}'s token {s.token[i]} lies {dist(s.below[i], s.below_ulp[i])} below the EOS "
        f"and is its best non-EOS candidate; {_moved(f, i)}; {drift_text(f, f.main, i)}; "
        f"both streams complete; later positions follow different tokens and are not compared"
    )


def _benign_flip(f: Facts, i: int, cls: str) -> str:
    kind = "tie" if cls == "bf16_tie_flip" else "drift"
    nats = not (np.isfinite(f.a.gap_ulp[i]) or np.isfinite(f.b.gap_ulp[i]))
    where = f"in nats ({f.dtype[i]}; no raw logits)" if nats else f"on the {f.dtype[i]} grid"
    head = (
        f"tie {where}"
        if kind == "tie"
        else f"boundaries {f.a.boundary[i]} vs {f.b.boundary[i]}, a numeric-size gap {where}"
    )
    a, b = f.a, f.b
    gaps = (
        f"|gap| A {dist(a.gap[i], a.gap_ulp[i])} <= {tol(f, i, kind, a.gap_ulp[i])}, "
        f"B {dist(b.gap[i], b.gap_ulp[i])} <= {tol(f, i, kind, b.gap_ulp[i])}"
    )
    if kind == "tie" and not (tie_ok(f, a)[i] and tie_ok(f, b)[i]):  # the gap-move tie (a calibration's)
        total, healthy = move_text(f, i)
        gaps = (
            f"|gap| A {dist(a.gap[i], a.gap_ulp[i])} + B {dist(b.gap[i], b.gap_ulp[i])} = {total} moved, within "
            f"this engine's healthy top-2 gap move {healthy} (calibrated p100; beyond the per-side tie "
            f"{tol(f, i, kind, a.gap_ulp[i])})"
        )
    return f"{head}: {gaps}; each chose its own top-1; {_moved(f, i)}; {drift_text(f, f.main, i)}"
