"""Checks of what each engine reported, at every compared position of every pair.

A verdict leans on the engine's own numbers; an engine that misreports them (top-k rows out
of order, a logprob above 0, a top-k whose mass exceeds 1, a reused-prefix count that is no
block boundary) can make a bug look benign, so each is checked on every row, not only at
the first difference:

  topk_order    each top-k row's logprobs non-increasing (within 1e-3 nats; NaN padding at the end)
  logprob_sign  chosen logprobs and top-k logprobs <= 0 (+ 1e-3)
  row_mass      logsumexp of each top-k row <= 0 (+ log 1.01): probabilities sum to <= 1.01
  cached_tokens <= the prompt's length, and a multiple of the engine's KV block size where
                the engine reports one (the reference engine does: /v1/models meta.block_size)

A pair with a failure on either side is `unexplained`, the failure named with its position
and numbers. Teacher-forced rows are not an engine's report and are not checked here.
"""

from __future__ import annotations

import numpy as np

from .align import Alignment
from .evidence import POSITIVE_LIMIT, SUM_LIMIT

# The same limits as the rows at the first difference (evidence.py): one home each.
LP_TOL = POSITIVE_LIMIT  # a logprob above this is a probability above 1 (rounding gives ~1e-6)
MASS_TOL = float(np.log(SUM_LIMIT))  # a top-k mass above 1.01 is no rounding
# An entry may exceed one listed before it by rounding only (float32 / BF16 storage of values
# the engine ranked in higher precision); a swap of real candidates is larger than this.
ORDER_TOL = POSITIVE_LIMIT


def _first(mask: np.ndarray, seg: np.ndarray, pos: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """(per pair the first position where mask holds, -1 when none; its index in [T])."""
    hit = np.flatnonzero(mask)
    first_pos, first_idx = np.full(P, -1, np.int64), np.full(P, -1, np.int64)
    segs, first = np.unique(seg[hit], return_index=True)
    first_pos[segs], first_idx[segs] = pos[hit[first]], hit[first]
    return first_pos, first_idx


def _rows_checks(side, idx: np.ndarray, seg: np.ndarray, pos: np.ndarray, P: int, label: str) -> np.ndarray:
    """Per pair the reason of the first failed row check of one side ('' when none).
    Float32 and adjacent comparisons only: this runs over every compared row [T, k]."""
    out = np.full(P, "", dtype=object)
    if not len(idx) or side.meta.source == "teacher_forced":
        return out
    lps = side.reader.column("topk_logprob")  # [N, k] float32, the whole file: no [T, k] copy
    if lps.ndim != 2 or lps.shape[1] == 0:
        return out  # no top-k stored: nothing reported to check (the classifier says what it cannot prove)
    with np.errstate(invalid="ignore", over="ignore"):
        # topk_order: an entry above the one before it (NaN compares False), or a value after a gap
        disorder = (lps[:, 1:] > lps[:, :-1] + np.float32(ORDER_TOL)).any(1)
        nan = np.isnan(lps)
        if nan.any():
            disorder |= (nan[:, :-1] & ~nan[:, 1:]).any(1)
        positive = (side.logprob > LP_TOL) | (lps > LP_TOL).any(1)
        mass = np.exp(lps).sum(1, where=~nan, dtype=np.float64) if nan.any() else np.exp(lps).sum(1, dtype=np.float64)
    disorder, positive, mass = disorder[idx], positive[idx], mass[idx]
    heavy = mass > SUM_LIMIT
    if not (disorder.any() or positive.any() or heavy.any()):
        return out
    lps, chosen = lps[idx], side.logprob[idx]
    fin = np.isfinite(lps)
    checks = [
        (disorder, lambda i: f"{label}'s top-k row at t={int(pos[i])} is not sorted by logprob ({_row(lps[i])})"),
        (positive, lambda i: f"{label} reports a logprob above 0 at t={int(pos[i])} (chosen {chosen[i]:.4g}, "
         f"top-k max {np.nanmax(np.where(fin[i], lps[i], np.nan)):.4g})"),
        (heavy, lambda i: f"{label}'s top-k probabilities at t={int(pos[i])} sum to {mass[i]:.4f} > 1"),
    ]  # fmt: skip
    for mask, say in checks:
        fp, fi = _first(mask, seg, pos, P)
        for p in np.flatnonzero((fp >= 0) & (out == "")).tolist():
            out[p] = say(int(fi[p]))
    return out


def _row(v: np.ndarray) -> str:
    return ", ".join(f"{x:.3g}" for x in v[:5]) + (", ..." if len(v) > 5 else "")


def _cached(side, rows: np.ndarray, label: str) -> np.ndarray:
    """cached_tokens within the prompt, and on a block boundary where the engine says its block size."""
    out = np.full(len(rows), "", dtype=object)
    if side.meta.source == "teacher_forced":
        return out
    block = side.meta.record.cache.block_size
    t = side.table
    for i in np.flatnonzero(rows >= 0).tolist():
        c, n = int(t.cached_tokens[rows[i]]), int(t.prompt_len[rows[i]])
        if c < 0:
            continue
        if n > 0 and c > n:
            out[i] = f"{label} reports cached_tokens {c} for a prompt of {n} tokens"
        elif block and c % block:
            out[i] = f"{label} reports cached_tokens {c}, not a multiple of its KV block size {block}"
    return out


def reported_checks(al: Alignment) -> np.ndarray:
    """Per pair [P] the reasons ('; '-joined) its sides' reported numbers fail; '' when sound."""
    P = len(al.keys)
    ra = _rows_checks(al.a, al.idx_a, al.seg, al.pos, P, "A")
    rb = _rows_checks(al.b, al.idx_b, al.seg, al.pos, P, "B")
    ca, cb = _cached(al.a, al.row_a, "A"), _cached(al.b, al.row_b, "B")
    out = np.full(P, "", dtype=object)
    for i in range(P):
        out[i] = "; ".join(x for x in (ra[i], rb[i], ca[i], cb[i]) if x)
    return out
