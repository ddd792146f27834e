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

from tracekit.rowcheck import row_mass

from .align import Alignment
from .window import token_rows

# The limits (one home each: tracekit/rowcheck.py): POSITIVE_LIMIT and SUM_LIMIT, as at the first
# difference; ORDER_TOL: an entry may exceed one listed before it by rounding only (float32 / BF16
# storage of values the engine ranked in higher precision); a swap of real candidates is larger.


def _first(mask: np.ndarray, seg: np.ndarray, pos: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """(per pair the first position where mask holds, -1 when none; its index in [T])."""
    hit = np.flatnonzero(mask)
    first_pos, first_idx = np.full(P, -1, np.int64), np.full(P, -1, np.int64)
    segs, first = np.unique(seg[hit], return_index=True)
    first_pos[segs], first_idx[segs] = pos[hit[first]], hit[first]
    return first_pos, first_idx


def _rows_checks(side, idx: np.ndarray, seg: np.ndarray, pos: np.ndarray, P: int, label: str, take) -> np.ndarray:
    """Per pair the reason of the first failed row check of one side ('' when none). The
    checks were made on every row as the side was read (rowscan.py); only the rows a
    reason quotes are read again here."""
    out = np.full(P, "", dtype=object)
    rs = side.scan
    if not len(idx) or side.meta.source == "teacher_forced" or rs is None:
        return out  # no top-k stored: nothing reported to check (the classifier says what it cannot prove)
    if not (rs.disorder.any() or rs.positive.any() or rs.heavy.any()):
        return out  # no row of the side fails: none of the compared ones (no [T] take)
    disorder, positive, heavy = take(rs.disorder), take(rs.positive), take(rs.heavy)
    if not (disorder.any() or positive.any() or heavy.any()):
        return out

    def row(i: int) -> np.ndarray:
        return token_rows(side.reader, "topk_logprob", idx[i : i + 1])[0]

    def top_max(i: int) -> float:
        v = row(i)
        return float(np.nanmax(np.where(np.isfinite(v), v, np.nan))) if np.isfinite(v).any() else float("nan")

    def mass(i: int) -> float:
        return float(row_mass(row(i)[None])[0])

    chosen = side.logprob
    checks = [
        (disorder, lambda i: f"{label}'s top-k row at t={int(pos[i])} is not sorted by logprob ({_row(row(i))})"),
        (positive, lambda i: f"{label} reports a logprob above 0 at t={int(pos[i])} (chosen {chosen[idx[i]]:.4g}, "
         f"top-k max {top_max(i):.4g})"),
        (heavy, lambda i: f"{label}'s top-k probabilities at t={int(pos[i])} sum to {mass(i):.4f} > 1"),
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
    has = rows >= 0
    c = np.where(has, side.table.cached_tokens[np.maximum(rows, 0)], -1).astype(np.int64)
    n = np.where(has, side.table.prompt_len[np.maximum(rows, 0)], -1).astype(np.int64)
    over = (c >= 0) & (n > 0) & (c > n)
    off = (c >= 0) & ~over & (c % block != 0) if block else np.zeros(len(rows), bool)
    for i in np.flatnonzero(over).tolist():
        out[i] = f"{label} reports cached_tokens {c[i]} for a prompt of {n[i]} tokens"
    for i in np.flatnonzero(off).tolist():
        out[i] = f"{label} reports cached_tokens {c[i]}, not a multiple of its KV block size {block}"
    return out


def reported_checks(al: Alignment) -> np.ndarray:
    """Per pair [P] the reasons ('; '-joined) its sides' reported numbers fail; '' when sound."""
    P = len(al.keys)
    ra = _rows_checks(al.a, al.idx_a, al.seg, al.pos, P, "A", al.take_a)
    rb = _rows_checks(al.b, al.idx_b, al.seg, al.pos, P, "B", al.take_b)
    ca, cb = _cached(al.a, al.row_a, "A"), _cached(al.b, al.row_b, "B")
    out = np.full(P, "", dtype=object)
    for i in np.flatnonzero((ra != "") | (rb != "") | (ca != "") | (cb != "")).tolist():
        out[i] = "; ".join(x for x in (ra[i], rb[i], ca[i], cb[i]) if x)
    return out
