"""Classify every aligned pair by the divergence taxonomy, vectorised.

All per-position work runs on the concatenated rows of every pair [T] with
numpy; Python touches each pair at most once (to format its rule text).
Top-k rows are read only at the D divergence positions. Rules, in order
(docs/analysis.md has the reasons and defaults):

  incomparable  missing / failed / different prompt (decided in align.py)
  identical     same ids over the compared length and the same length
  post_eos      the first difference lies after an EOS in A
  bf16_tie_flip both traces' gaps between the two tokens within the tie
                tolerance (ULPs with raw logits, nats otherwise), drift ok
  cache_boundary boundaries differ (both known) and gaps + drift within the
                drift tolerance
  unexplained   anything else
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.errors import ConfigError
from tracekit.store import read_token_rows

from .align import Alignment

CLASSES = ("incomparable", "identical", "post_eos", "bf16_tie_flip", "cache_boundary", "unexplained")


@dataclass(frozen=True)
class Thresholds:
    """Tolerances (docs/analysis.md says why each default)."""

    tie_ulps: float = 4.0  # |gap| in BF16 ULPs at the logits' magnitude, when raw logits exist
    tie_nats: float = 0.125  # |gap| in nats, logprobs only (= 4 ULPs at |logit| in [4, 8))
    drift_nats: float = 0.5  # pre-divergence drift and cache_boundary gaps

    def __post_init__(self) -> None:
        for name in ("tie_ulps", "tie_nats", "drift_nats"):
            v = getattr(self, name)
            if not (v >= 0 and np.isfinite(v)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        if self.drift_nats < self.tie_nats:
            raise ConfigError(
                f"--drift-nats ({self.drift_nats}) must be >= --tie-nats ({self.tie_nats}): "
                "the drift tolerance is the looser one"
            )


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """BF16 unit in the last place at magnitude |x|: 2^(floor(log2|x|) - 7) (8-bit significand)."""
    mag = np.maximum(np.abs(np.asarray(x, dtype=np.float64)), 2.0**-126)
    return np.exp2(np.floor(np.log2(mag)) - 7)


def first_divergence(al: Alignment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t [P] first differing position (= L when none), ta [T], tb [T] aligned ids)."""
    ta, tb = al.a.token_id[al.idx_a], al.b.token_id[al.idx_b]
    t = al.length.copy()
    mism = np.flatnonzero(ta != tb)
    segs, first = np.unique(al.seg[mism], return_index=True)
    t[segs] = al.pos[mism[first]]
    return t, ta, tb


def drift(al: Alignment, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair over positions < t: max and mean |Δ chosen logprob| (NaN when no
    position compares) and whether every chosen logprob is bitwise equal."""
    la, lb = al.a.logprob[al.idx_a], al.b.logprob[al.idx_b]
    P = len(t)
    dmax, mean = np.full(P, np.nan), np.full(P, np.nan)
    bitwise = np.ones(P, bool)
    nz = np.flatnonzero(al.length > 0)
    if not len(nz):
        return dmax, mean, bitwise
    starts = al.start[nz]
    pre = al.pos < t[al.seg]
    d = np.abs(la - lb)  # float32 [T]; NaN where either logprob is unknown
    d[~pre] = np.nan
    valid = ~np.isnan(d)
    cnt = np.add.reduceat(valid, starts, dtype=np.int64)
    dmax[nz] = np.fmax.reduceat(d, starts)
    d[~valid] = 0
    mean[nz] = np.where(cnt > 0, np.add.reduceat(d, starts, dtype=np.float64) / np.maximum(cnt, 1), np.nan)
    bits_differ = pre & (la.view(np.uint32) != lb.view(np.uint32))
    bitwise[nz] = np.add.reduceat(bits_differ, starts, dtype=np.int64) == 0
    return dmax, mean, bitwise


def eos_before(al: Alignment, ta: np.ndarray, t: np.ndarray, eos_ids: np.ndarray) -> np.ndarray:
    """[P] first position < t where A emitted an EOS id, -1 when none."""
    hit = np.flatnonzero(np.isin(ta, eos_ids) & (al.pos < t[al.seg]))
    out = np.full(len(t), -1, dtype=np.int64)
    segs, first = np.unique(al.seg[hit], return_index=True)
    out[segs] = al.pos[hit[first]]
    return out


@dataclass(frozen=True)
class SideGap:
    """At D divergence rows of one trace: gap (nats) from its own token to the
    other's, the same in BF16 ULPs (NaN without raw logits), whether the other
    token is in its top-k (when not, `nats` is only a lower bound)."""

    nats: np.ndarray
    ulp: np.ndarray
    has_other: np.ndarray


def side_gap(
    ids: np.ndarray,
    lps: np.ndarray,
    logits: np.ndarray | None,
    mine: np.ndarray,
    other: np.ndarray,
    chosen_lp: np.ndarray,
) -> SideGap:
    """ids/lps/logits [D, k] top-k rows; mine/other [D] token ids; chosen_lp [D]."""
    D = len(mine)
    if not ids.shape[1]:  # a trace without top-k: no gap can be measured
        return SideGap(np.full(D, np.nan), np.full(D, np.nan), np.zeros(D, bool))
    r = np.arange(D)
    m_mine, m_other = ids == mine[:, None], ids == other[:, None]
    has_mine, has_other = m_mine.any(1), m_other.any(1)
    j_mine, j_other = m_mine.argmax(1), m_other.argmax(1)
    lps = lps.astype(np.float64)
    lp_mine = np.where(has_mine, lps[r, j_mine] if D else 0.0, chosen_lp)
    lp_other = np.where(has_other, lps[r, j_other] if D else 0.0, np.nan)
    floor = np.where(np.isnan(lps), np.inf, lps).min(1) if lps.shape[1] else np.full(D, np.nan)
    nats = np.where(has_other, lp_mine - lp_other, lp_mine - floor)
    nats[~np.isfinite(nats)] = np.nan
    ulp = np.full(D, np.nan)
    if logits is not None and D:
        lg = logits.astype(np.float64)
        g_mine = np.where(has_mine, lg[r, j_mine], np.nan)
        g_other = np.where(has_other, lg[r, j_other], np.nan)
        ulp = (g_mine - g_other) / bf16_ulp(np.fmax(np.abs(g_mine), np.abs(g_other)))
    return SideGap(nats, ulp, has_other)


def topk_overlap(ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
    """[D] share of A's top-k ids also in B's top-k, over the narrower width (NaN if none)."""
    k = min(ids_a.shape[1], ids_b.shape[1])
    A, B = ids_a[:, :k], ids_b[:, :k]
    valid = A >= 0
    hits = ((A[:, :, None] == B[:, None, :]).any(2) & valid).sum(1)
    n = valid.sum(1)
    return np.where(n > 0, hits / np.maximum(n, 1), np.nan)


def fetch_rows(side, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Top-k ids, logprobs and (if stored) raw logits at token rows `rows`."""
    r = side.reader
    logits = read_token_rows(r, "topk_logit", rows) if r.has_column("topk_logit") else None
    return read_token_rows(r, "topk_id", rows), read_token_rows(r, "topk_logprob", rows), logits


def _tie_ok(g: SideGap, thr: Thresholds) -> np.ndarray:
    # Per side: ULPs when this trace has raw logits for both tokens, nats otherwise.
    return g.has_other & np.where(np.isfinite(g.ulp), np.abs(g.ulp) <= thr.tie_ulps, np.abs(g.nats) <= thr.tie_nats)


def flip_evidence(
    al: Alignment, t: np.ndarray, div: np.ndarray, token_a: np.ndarray, token_b: np.ndarray, thr: Thresholds
) -> dict[str, np.ndarray]:
    """At the D pairs that differ inside the compared length: gaps, top-k
    membership and overlap, and whether the tie / numeric-gap tests pass. [P] each."""
    P = len(t)

    def f():
        return np.full(P, np.nan)

    ev = dict(gap_a=f(), gap_b=f(), gap_a_ulp=f(), gap_b_ulp=f(), topk_overlap=f())
    for name in ("b_in_topk_a", "a_in_topk_b", "tie", "numeric"):
        ev[name] = np.zeros(P, bool)
    D = np.flatnonzero(div)
    rows_a, rows_b = al.off_a[D] + t[D], al.off_b[D] + t[D]
    ids_a, lps_a, lg_a = fetch_rows(al.a, rows_a)
    ids_b, lps_b, lg_b = fetch_rows(al.b, rows_b)
    ga = side_gap(ids_a, lps_a, lg_a, token_a[D], token_b[D], al.a.logprob[rows_a].astype(np.float64))
    gb = side_gap(ids_b, lps_b, lg_b, token_b[D], token_a[D], al.b.logprob[rows_b].astype(np.float64))
    ev["gap_a"][D], ev["gap_b"][D], ev["gap_a_ulp"][D], ev["gap_b_ulp"][D] = ga.nats, gb.nats, ga.ulp, gb.ulp
    ev["b_in_topk_a"][D], ev["a_in_topk_b"][D] = ga.has_other, gb.has_other
    ev["topk_overlap"][D] = topk_overlap(ids_a, ids_b)
    ev["tie"][D] = _tie_ok(ga, thr) & _tie_ok(gb, thr)
    ev["numeric"][D] = (
        ga.has_other & gb.has_other & (np.abs(ga.nats) <= thr.drift_nats) & (np.abs(gb.nats) <= thr.drift_nats)
    )
    return ev


def _take(col: np.ndarray, rows: np.ndarray, mask: np.ndarray, fill: int = -1) -> np.ndarray:
    """col[rows] where mask, else fill; safe when col is empty (every request failed)."""
    if not len(col) or not mask.any():
        return np.full(len(rows), fill, dtype=np.int64)
    return np.where(mask, col[np.where(mask, rows, 0)], fill)


def classify(al: Alignment, thr: Thresholds, eos_ids: np.ndarray) -> dict[str, np.ndarray]:
    """All result columns [P] except `rule` and `teacher`."""
    P = len(al.keys)
    t, ta, tb = first_divergence(al)
    dmax, dmean, bitwise = drift(al, t)
    eos_pos = eos_before(al, ta, t, np.asarray(eos_ids, dtype=np.int32))
    comparable = al.incomparable == ""

    def bound(side, rows):
        return np.where(rows >= 0, side.table.cached_tokens[np.maximum(rows, 0)], -1)

    ba, bb = bound(al.a, al.row_a).astype(np.int64), bound(al.b, al.row_b).astype(np.int64)
    identical = comparable & (t == al.length) & (al.n_a == al.n_b)
    div = comparable & (t < al.length)
    at = div | (comparable & (t == al.length) & (al.n_a != al.n_b))  # or one side ended early
    # Tokens at t (-1 where that side has no row t).
    has_a, has_b = at & (t < al.n_a), at & (t < al.n_b)
    token_a = _take(al.a.token_id, al.off_a + t, has_a)
    token_b = _take(al.b.token_id, al.off_b + t, has_b)
    ev = flip_evidence(al, t, div, token_a, token_b, thr)
    tie, numeric = ev.pop("tie"), ev.pop("numeric")

    # vLLM's check_logprobs_close: at the first difference each token is in the
    # other's top-k; sequences equal over zip() pass. 1 pass, 0 fail, -1 n/a.
    vllm = np.where(comparable, 1, -1).astype(np.int8)
    vllm[div] = (ev["b_in_topk_a"] & ev["a_in_topk_b"])[div]

    drift_ok = np.isnan(dmax) | (dmax <= thr.drift_nats)
    boundary_differs = (ba >= 0) & (bb >= 0) & (ba != bb)
    post = at & (eos_pos >= 0)
    cls = np.full(P, "unexplained", dtype=object)
    cls[~comparable] = "incomparable"
    cls[identical] = "identical"
    cls[post] = "post_eos"
    cls[div & ~post & drift_ok & ~tie & boundary_differs & numeric] = "cache_boundary"
    cls[div & ~post & drift_ok & tie] = "bf16_tie_flip"
    return dict(
        key=al.keys,
        cls=cls,
        position=np.where(at, t, -1),
        token_a=token_a,
        token_b=token_b,
        boundary_a=ba,
        boundary_b=bb,
        drift_max=dmax,
        drift_mean=dmean,
        bitwise=bitwise & comparable,
        vllm_close=vllm,
        len_a=al.n_a,
        len_b=al.n_b,
        compared=al.length,
        eos_pos=eos_pos,
        incomparable=al.incomparable,
        **ev,
    )
