"""The evidence at each first difference: every number a benign claim rests on.

For the D pairs whose tokens differ at position t (t < compared length), the
top-k rows of both traces at t are read (only those rows) and, vectorised over
the D pairs, this module measures for each side s (own token x_s, the other
side's token y):

  gap_s        value_s(x_s) - value_s(y)                nats (a lower bound when y is not in s's top-k),
               and steps of the pair's grid when s stored logits
  below_s      how far s's choice lies below its own top-1, by logit and by logprob
  agree_s      (logit gap) - (logprob gap): logits and logprobs must tell the same gap
  move_x       value_B(x) - value_A(x) for x in (token_a, token_b): how far each candidate
               moved between the traces (steps of logits when both have them, and nats)
  row_bad_s    what is wrong with s's row itself (flags below)

into facts.SideEvidence; checks.py judges each against the pair's tolerances
(classify.Tol, per dtype):

- greedy: the chosen token is its own top-1 by logit AND by logprob, ties
  allowed and nothing else. Engines report the values they take the argmax of,
  and rounding is monotone, so a greedy choice is never below its own top-1;
- tie / numeric: each gap within the tie / drift tolerance;
- moved: each candidate's logit within the drift tolerance in steps; its
  logprob within the drift tolerance in nats (without logits), or, with logits,
  its logprob moved like its logit up to the drift tolerance at the row's scale
  (the normaliser cannot move more than the logits do);
- agree: logit and logprob gaps equal within the tie tolerance at the row's scale;
- a sane row: ids unique, no +inf, no logprob > 0, probabilities summing to at
  most 1, no unknown id (-1) at or above the choice, both candidates' logits
  finite where the row has logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.rowcheck import POSITIVE_LIMIT, SUM_LIMIT  # noqa: F401 (their home: the row checks)

from .grid import spacing, steps
from .window import token_rows

# row_bad flags (checks.py words them)
DUP_ID, POS_INF, POSITIVE_LP, SUM_OVER_ONE, UNKNOWN_ABOVE, CAND_LOGIT, COLUMN = 1, 2, 4, 8, 16, 32, 64
COLUMN_NATS = 1e-4  # the chosen-logprob column and the top-k row come from one response
GREEDY_NATS = 1e-6  # float32 logprobs of equal logits are equal; this only absorbs their last bit


@dataclass(frozen=True)
class SideRow:
    """One trace's top-k row at D divergence positions, seen from its own token."""

    has_mine: np.ndarray  # [D] bool: own token in own top-k
    has_other: np.ndarray  # [D] bool: the other side's token in own top-k
    lp_mine: np.ndarray  # [D] float64 nats (the chosen column's value when not in top-k)
    lp_other: np.ndarray  # NaN when not in top-k
    lg_mine: np.ndarray  # raw logits, NaN when not stored
    lg_other: np.ndarray
    top1: np.ndarray  # [D] int64 the top-1 id (by logit where the row has logits), -1 when none
    lp_top: np.ndarray  # the largest logprob of the row (any entry)
    lg_top: np.ndarray  # the largest logit of the row
    top1_lp: np.ndarray  # [D] int64 the id with the largest logprob
    scale: np.ndarray  # [D] the row's magnitude: max |logit| of top-1 and both candidates (NaN w/o logits)
    gap: np.ndarray  # nats: lp_mine - lp_other, or a lower bound to the lowest top-k entry
    bad: np.ndarray  # [D] int: row_bad flags
    prob_sum: np.ndarray  # [D] sum of the row's probabilities
    detail: np.ndarray  # [D, 6] float: numbers for the flags' texts (see _details)


def _argmax(score: np.ndarray, ids: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.where(ok, score, -np.inf)
    j = s.argmax(1)
    r = np.arange(len(ids))
    best = s[r, j]
    return np.where(np.isneginf(best), -1, ids[r, j]).astype(np.int64), np.where(np.isneginf(best), np.nan, best)


def side_row(ids: np.ndarray, lps: np.ndarray, logits: np.ndarray | None, mine, other, chosen_lp) -> SideRow:
    """ids/lps/logits [D, k] top-k rows; mine/other [D] token ids; chosen_lp [D]."""
    D, k = ids.shape
    nan = np.full(D, np.nan)
    if not k:  # a trace without top-k: nothing can be measured
        no, zero = np.zeros(D, bool), np.zeros(D, np.int64)
        neg, det = np.full(D, -1), np.full((D, 6), np.nan)
        return SideRow(no, no, chosen_lp.copy(), nan, nan, nan, neg, nan, nan, neg, nan, nan, zero, nan, det)
    r = np.arange(D)
    lps = lps.astype(np.float64)
    lg = logits.astype(np.float64) if logits is not None else np.full((D, k), np.nan)
    valid = ids >= 0
    m_mine, m_other = (ids == mine[:, None]) & valid, (ids == other[:, None]) & valid
    has_mine, has_other = m_mine.any(1), m_other.any(1)
    j_mine, j_other = m_mine.argmax(1), m_other.argmax(1)
    lp_mine = np.where(has_mine, lps[r, j_mine], chosen_lp)
    lp_other = np.where(has_other, lps[r, j_other], np.nan)
    lg_mine = np.where(has_mine, lg[r, j_mine], np.nan)
    lg_other = np.where(has_other, lg[r, j_other], np.nan)
    row_lg = np.isfinite(lg).any(1)
    # Top-1 by logit (+inf counts: it is the top) and by logprob, over every listed id.
    top_lg, lg_top = _argmax(lg, ids, valid & ~np.isnan(lg))
    top_lp, lp_top = _argmax(lps, ids, valid & ~np.isnan(lps))
    top1 = np.where(row_lg, top_lg, top_lp)
    scale = np.fmax(np.fmax(np.abs(np.where(np.isfinite(lg_top), lg_top, np.nan)), np.abs(lg_mine)), np.abs(lg_other))
    finite_lps = np.where(np.isfinite(lps) & valid, lps, np.inf)
    gap = np.where(has_other, lp_mine - lp_other, lp_mine - finite_lps.min(1))
    gap[~np.isfinite(gap)] = np.nan
    # What is wrong with the row itself.
    sorted_ids = np.sort(np.where(valid, ids, -1 - np.arange(k)), axis=1)  # invalid slots never equal
    prob_sum = np.where(valid & np.isfinite(lps), np.exp(np.minimum(lps, 50.0)), 0.0).sum(1)
    unknown = ~valid & (np.isfinite(lps) | np.isfinite(lg))
    above = (np.where(unknown, lps, -np.inf) >= lp_mine[:, None]) | (np.where(unknown, lg, -np.inf) >= lg_mine[:, None])
    col_off = has_mine & np.isfinite(chosen_lp) & np.isfinite(lp_mine)
    col_off &= np.abs(chosen_lp - lp_mine) > COLUMN_NATS * np.maximum(1, np.abs(lp_mine))
    dup = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(1)
    bad = (
        COLUMN * col_off
        + DUP_ID * dup
        + POS_INF * (np.isposinf(lps) | np.isposinf(lg)).any(1)
        + POSITIVE_LP * (np.where(valid, lps, -np.inf) > POSITIVE_LIMIT).any(1)
        + SUM_OVER_ONE * (prob_sum > SUM_LIMIT)
        + UNKNOWN_ABOVE * (unknown & above).any(1)
        + CAND_LOGIT * (row_lg & (~np.isfinite(lg_mine) | (has_other & ~np.isfinite(lg_other))))
    ).astype(np.int64)
    detail = _details(ids, lps, lg, valid, unknown, chosen_lp, lp_mine, dup)
    return SideRow(
        has_mine,
        has_other,
        lp_mine,
        lp_other,
        lg_mine,
        lg_other,
        top1,
        lp_top,
        lg_top,
        top_lp,
        scale,
        gap,
        bad,
        prob_sum,
        detail,
    )


def _details(ids, lps, lg, valid, unknown, chosen_lp, lp_mine, dup) -> np.ndarray:
    """[D, 6] numbers the rule text quotes: the chosen-logprob column's value, the
    largest logprob, how far an unknown id lies above the choice, the first repeated
    id and its first two logprobs (dup [D]: the rows holding a repeated id). The
    non-finite candidate logit is lg_mine / lg_other."""
    D, k = ids.shape
    out = np.full((D, 6), np.nan)
    out[:, 0] = chosen_lp
    out[:, 1] = np.where(valid & ~np.isnan(lps), lps, -np.inf).max(1)
    out[:, 2] = np.where(unknown, lps, -np.inf).max(1) - lp_mine
    for i in np.flatnonzero(dup).tolist():  # rows with a repeated id are rare: the loop runs over those only
        v = ids[i][valid[i]]
        if len(np.unique(v)) < len(v):
            u, c = np.unique(v, return_counts=True)
            out[i, 3] = u[c > 1][0]
            out[i, 4:6] = lps[i][ids[i] == out[i, 3]][:2]
    return out


def fetch_rows(side, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Top-k ids, logprobs and (if stored) raw logits at token rows `rows`."""
    r = side.reader
    logits = token_rows(r, "topk_logit", rows) if r.has_column("topk_logit") else None
    kept = side.scan.rows(rows) if side.scan is not None else None  # kept by the side's top-k pass
    if kept is not None:
        return kept[0], kept[1], logits
    return token_rows(r, "topk_id", rows), token_rows(r, "topk_logprob", rows), logits


def topk_overlap(ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """[D] share of A's top-k ids also in B's top-k, over the narrower width (NaN if none)."""
    k = min(ids_a.shape[1], ids_b.shape[1])
    A, B = ids_a[:, :k], ids_b[:, :k]
    valid = A >= 0
    hits = ((A[:, :, None] == B[:, None, :]).any(2) & valid).sum(1)
    n = valid.sum(1)
    return np.where(n > 0, hits / np.maximum(n, 1), np.nan)


def _unit(row: SideRow, bits, floor_abs: float) -> np.ndarray:
    """One grid step at the row's scale (its top), never finer than at the floor |x|."""
    return spacing(np.fmax(row.scale, floor_abs), bits)


def measure(a: SideRow, b: SideRow, bits, bits_a, bits_b, tol, floor_abs: float) -> tuple[dict, dict]:
    """Each side's row fields of facts.SideEvidence [D] (numbers only: checks.py judges
    them). bits: the pair's (coarser) grid; bits_a/bits_b each side's own grid (its greedy
    check). tol: dict of [D] tolerance arrays (classify.tol_columns)."""
    out: tuple[dict, dict] = ({}, {})
    for ev, row, own_bits in ((out[0], a, bits_a), (out[1], b, bits_b)):
        below_ulp = steps(row.lg_top, row.lg_mine, own_bits, row.scale, floor_abs)
        ev["gap"], ev["gap_ulp"] = row.gap, steps(row.lg_mine, row.lg_other, bits, row.scale, floor_abs)
        ev["below"], ev["below_ulp"] = row.lp_top - row.lp_mine, below_ulp
        ev["top1"] = np.where(np.isfinite(below_ulp) & (below_ulp > 0), row.top1, row.top1_lp)
        ev["lp_top"], ev["lg_top"] = row.lp_top, row.lg_top
        ev["agree"] = (row.lg_mine - row.lg_other) - (row.lp_mine - row.lp_other)
        ev["agree_tol"] = tol["tie_ulps"] * _unit(row, bits, floor_abs)
        ev["own_in_topk"], ev["other_in_topk"] = row.has_mine, row.has_other
        ev["row_bad"], ev["prob_sum"] = row.bad, row.prob_sum
        det = row.detail.T
        ev["col_lp"], ev["max_lp"], ev["unk_above"], ev["dup_id"] = det[:4]
        ev["dup_lp1"], ev["dup_lp2"] = det[4:6]
        ev["topk_lp"], ev["lg_mine"], ev["lg_other"] = row.lp_mine, row.lg_mine, row.lg_other
    scale = np.fmax(a.scale, b.scale)
    unit = np.fmax(_unit(a, bits, floor_abs), _unit(b, bits, floor_abs))
    # token_a: A's own, B's other; token_b: A's other, B's own. Movement = B - A.
    for ev, (lg_a, lp_a, lg_b, lp_b) in (
        (out[0], (a.lg_mine, a.lp_mine, b.lg_other, b.lp_other)),
        (out[1], (a.lg_other, a.lp_other, b.lg_mine, b.lp_mine)),
    ):
        ev["move"], ev["move_ulp"] = lp_b - lp_a, steps(lg_b, lg_a, bits, scale, floor_abs)
        # With logits on both sides the logprob may move as its logit does plus the shift of
        # the normaliser, which a bounded move of every logit bounds by the same amount.
        ev["lse"], ev["lse_tol"] = (lp_b - lp_a) - (lg_b - lg_a), tol["drift_ulps"] * unit
    return out
