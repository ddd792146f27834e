"""The evidence at each first difference: every number a benign claim rests on.

For the D pairs whose tokens differ at position t (t < compared length), the
top-k rows of both traces at t are read (only those rows) and, vectorised over
the D pairs, this module measures for each side s (own token x_s, the other
side's token y):

  gap_s        logprob_s(x_s) - logprob_s(y)            nats (a lower bound when y is not in s's top-k)
  gap_s_ulp    logit_s(x_s) - logit_s(y)                steps of the pair's grid, when s stored logits
  below_s      top1_s - x_s: how far s's choice lies below its own top-1 (nats; steps with logits)
  agree_s      (logit gap) - (logprob gap): logits and logprobs must tell the same gap
  move_x       value_B(x) - value_A(x) for x in (token_a, token_b): how far each candidate
               moved between the traces (steps of logits when both have them, else logprob nats)

and checks each against the tolerances of the pair (classify.Tol, per dtype):
greedy (below within the tie tolerance of the side's own grid), tie (gap within
the tie tolerance), numeric (gap within the drift tolerance), moved (within
the drift tolerance) and agree (within the tie tolerance on the grid at the
row's scale). The classifier combines them; result.py words them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.store import read_token_rows

from .grid import spacing, steps


@dataclass(frozen=True)
class SideRow:
    """One trace's top-k row at D divergence positions, seen from its own token."""

    has_mine: np.ndarray  # [D] bool: own token in own top-k
    has_other: np.ndarray  # [D] bool: the other side's token in own top-k
    lp_mine: np.ndarray  # [D] float64 nats (the stored chosen logprob when not in top-k)
    lp_other: np.ndarray  # NaN when not in top-k
    lg_mine: np.ndarray  # raw logits, NaN when not stored
    lg_other: np.ndarray
    top1: np.ndarray  # [D] int64 id of the largest logit (logprob without logits), -1 when none
    lp_top: np.ndarray
    lg_top: np.ndarray
    scale: np.ndarray  # [D] the row's magnitude: max |logit| of top-1 and both candidates (NaN w/o logits)
    gap: np.ndarray  # nats: lp_mine - lp_other, or a lower bound to the lowest top-k entry


def side_row(
    ids: np.ndarray, lps: np.ndarray, logits: np.ndarray | None, mine: np.ndarray, other: np.ndarray, chosen_lp
) -> SideRow:
    """ids/lps/logits [D, k] top-k rows; mine/other [D] token ids; chosen_lp [D]."""
    D, k = ids.shape
    nan = np.full(D, np.nan)
    if not k:  # a trace without top-k: nothing can be measured
        no = np.zeros(D, bool)
        return SideRow(no, no, chosen_lp.copy(), nan, nan, nan, np.full(D, -1), nan, nan, nan, nan)
    r = np.arange(D)
    lps = lps.astype(np.float64)
    lg = logits.astype(np.float64) if logits is not None else np.full((D, k), np.nan)
    m_mine, m_other = (ids == mine[:, None]) & (ids >= 0), (ids == other[:, None]) & (ids >= 0)
    has_mine, has_other = m_mine.any(1), m_other.any(1)
    j_mine, j_other = m_mine.argmax(1), m_other.argmax(1)
    lp_mine = np.where(has_mine, lps[r, j_mine], chosen_lp)
    lp_other = np.where(has_other, lps[r, j_other], np.nan)
    lg_mine = np.where(has_mine, lg[r, j_mine], np.nan)
    lg_other = np.where(has_other, lg[r, j_other], np.nan)
    # Top-1 by raw logit where the row has logits, else by logprob.
    row_has_lg = np.isfinite(lg).any(1, keepdims=True)
    score = np.where(row_has_lg, lg, lps)
    score = np.where(np.isfinite(score) & (ids >= 0), score, -np.inf)
    jt = score.argmax(1)
    empty = np.isneginf(score[r, jt])
    top1 = np.where(empty, -1, ids[r, jt]).astype(np.int64)
    lp_top, lg_top = np.where(empty, np.nan, lps[r, jt]), np.where(empty, np.nan, lg[r, jt])
    scale = np.fmax(np.fmax(np.abs(lg_top), np.abs(lg_mine)), np.abs(lg_other))
    floor = np.where(np.isfinite(lps) & (ids >= 0), lps, np.inf).min(1)
    gap = np.where(has_other, lp_mine - lp_other, lp_mine - floor)
    gap[~np.isfinite(gap)] = np.nan
    return SideRow(has_mine, has_other, lp_mine, lp_other, lg_mine, lg_other, top1, lp_top, lg_top, scale, gap)


def fetch_rows(side, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Top-k ids, logprobs and (if stored) raw logits at token rows `rows`."""
    r = side.reader
    logits = read_token_rows(r, "topk_logit", rows) if r.has_column("topk_logit") else None
    return read_token_rows(r, "topk_id", rows), read_token_rows(r, "topk_logprob", rows), logits


def topk_overlap(ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """[D] share of A's top-k ids also in B's top-k, over the narrower width (NaN if none)."""
    k = min(ids_a.shape[1], ids_b.shape[1])
    A, B = ids_a[:, :k], ids_b[:, :k]
    valid = A >= 0
    hits = ((A[:, :, None] == B[:, None, :]).any(2) & valid).sum(1)
    n = valid.sum(1)
    return np.where(n > 0, hits / np.maximum(n, 1), np.nan)


def _within(ulp: np.ndarray, nats: np.ndarray, tol_ulp: np.ndarray, tol_nats: np.ndarray) -> np.ndarray:
    """|value| within tolerance: in steps where measured on logits, else in nats (NaN fails)."""
    return np.where(np.isfinite(ulp), np.abs(ulp) <= tol_ulp, np.abs(nats) <= tol_nats)


def measure(a: SideRow, b: SideRow, bits: np.ndarray, bits_a: np.ndarray, bits_b: np.ndarray, tol, tol_a, tol_b):
    """All evidence columns [D] and check flags. bits: the pair's (coarser) grid;
    bits_a/bits_b each side's own grid (its greedy check). tol/tol_a/tol_b: dicts
    of [D] tolerance arrays (classify.tol_columns)."""
    ev: dict[str, np.ndarray] = {}
    for s, row, own_bits, own_tol in (("a", a, bits_a, tol_a), ("b", b, bits_b, tol_b)):
        gap_ulp = steps(row.lg_mine, row.lg_other, bits, row.scale)
        below_ulp = steps(row.lg_top, row.lg_mine, own_bits, row.scale)
        below = row.lp_top - row.lp_mine
        agree = (row.lg_mine - row.lg_other) - (row.lp_mine - row.lp_other)
        agree_tol = tol["tie_ulps"] * spacing(row.scale, bits)
        ev[f"gap_{s}"], ev[f"gap_{s}_ulp"] = row.gap, gap_ulp
        ev[f"below_{s}"], ev[f"below_{s}_ulp"], ev[f"top1_{s}"] = below, below_ulp, row.top1
        ev[f"agree_{s}"], ev[f"agree_tol_{s}"] = agree, agree_tol
        ev[f"own_in_topk_{s}"] = row.has_mine
        ev[f"greedy_ok_{s}"] = row.has_mine & _within(below_ulp, below, own_tol["tie_ulps"], own_tol["tie_nats"])
        ev[f"tie_ok_{s}"] = row.has_other & _within(gap_ulp, row.gap, tol["tie_ulps"], tol["tie_nats"])
        ev[f"num_ok_{s}"] = row.has_other & _within(gap_ulp, row.gap, tol["drift_ulps"], tol["drift_nats"])
        ev[f"agree_ok_{s}"] = ~np.isfinite(agree) | (np.abs(agree) <= agree_tol)
    scale = np.fmax(a.scale, b.scale)
    # token_a: A's own, B's other; token_b: A's other, B's own. Movement = B - A.
    for s, (lg_a, lp_a, lg_b, lp_b) in (
        ("a", (a.lg_mine, a.lp_mine, b.lg_other, b.lp_other)),
        ("b", (a.lg_other, a.lp_other, b.lg_mine, b.lp_mine)),
    ):
        mv_ulp = steps(lg_b, lg_a, bits, scale)
        mv = lp_b - lp_a
        ev[f"move_{s}"], ev[f"move_{s}_ulp"] = mv, mv_ulp
        ev[f"move_ok_{s}"] = _within(mv_ulp, mv, tol["drift_ulps"], tol["drift_nats"])
    ev["b_in_topk_a"], ev["a_in_topk_b"] = a.has_other, b.has_other
    return ev
