"""One pass over a trace's [N, k] top-k columns, in blocks: what a diff needs of every row.

A diff reads the top-k ids and logprobs of every token row for two things: the chosen
token's own entry (to check the logprob column against it, sides.py) and the checks of what
the engine reported on every row (reported.py: order, sign, mass). Both are computed here
in one read, block by block, so neither column is held whole nor read twice:

  topk_lp    [N] the chosen token's entry in its row (NaN when absent)
  disorder   [N] an entry above the one before it by more than ORDER_TOL, or a value after a NaN
  positive   [N] the chosen logprob or a top-k logprob above POSITIVE_LIMIT
  heavy      [N] the row's probabilities (NaN entries left out) summing to more than SUM_LIMIT

Each check runs on a block (CACHE_BYTES: 1 MiB) as whole-block vector passes: the comparisons on the
flat block, the per-row "any" as ORs of the row's bytes read as wide ints, the mass as a
matrix-vector product; a reduction across each short row would cost numpy a call per row
(bench/diff_bench.py). The mass is summed in float32 and every row within 1e-3 of the limit
summed again in float64, so the verdict is the float64 sum's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .evidence import POSITIVE_LIMIT, SUM_LIMIT

ORDER_TOL = POSITIVE_LIMIT  # an entry may exceed one listed before it by rounding only
BLOCK_BYTES = 1 << 20  # rows read at a time, per column (whole stored chunks: the store's are ~1 MiB)
CACHE_BYTES = 1 << 20  # rows reduced at a time: fewer, longer numpy calls beat an L2-sized block (measured)


@dataclass(frozen=True)
class RowScan:
    topk_lp: np.ndarray  # [N] float32
    disorder: np.ndarray  # [N] bool
    positive: np.ndarray
    heavy: np.ndarray
    # the rows asked to be kept as they passed (the first differences: classify reads their
    # top-k there, evidence.fetch_rows), so that no chunk is read and checksummed twice
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [m] sorted unique token rows
    kept_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [m, k]
    kept_lps: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [m, k]

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(top-k ids, logprobs) [len(rows), k] of token rows `rows` when all were kept, else None."""
        if not len(self.kept):
            return None
        j = np.minimum(np.searchsorted(self.kept, rows), len(self.kept) - 1)
        if not len(rows) or not (self.kept[j] == rows).all():
            return None
        return self.kept_ids[j], self.kept_lps[j]


def pick(ids: np.ndarray, vals: np.ndarray, tok: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[n] vals at the first entry of each row whose id is tok (NaN when none).
    Engines list the chosen token first almost always: rank 0 is checked for every
    row, the whole row only for the rest. out: an [n] float32 array of NaN to write into."""
    out = np.full(len(tok), np.nan, np.float32) if out is None else out
    if not ids.shape[1] or not len(ids):
        return out
    first = np.equal(ids[:, 0], tok)
    first &= tok >= 0
    np.copyto(out, vals[:, 0], where=first)
    rest = np.flatnonzero(~first)
    if len(rest):
        sub = ids[rest]
        hit = (sub == tok[rest, None]) & (sub >= 0)
        j = hit.argmax(1)
        found = hit.any(1)
        out[rest[found]] = vals[rest[found], j[found]]
    return out


def row_mass(lps: np.ndarray) -> np.ndarray:
    """[n] float64 sum of exp over each row of [n, k] float32 logprobs, NaN entries left out."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(lps)
    return np.where(np.isnan(e), 0.0, e).sum(1, dtype=np.float64)


def _flags(lps: np.ndarray, chosen: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """(disorder, positive, heavy) [n] of rows [n, k] into `out`, CACHE_BYTES of rows at a time."""
    step = max(1, CACHE_BYTES // max(1, lps.itemsize * lps.shape[1]))
    for s in range(0, len(lps), step):
        _block_flags(lps[s : s + step], chosen[s : s + step], tuple(x[s : s + step] for x in out))


def _any_per_row(flat: np.ndarray, n: int, k: int) -> np.ndarray:
    """[n] whether each row of a flat bool [n * k] holds a True: the row's bytes read as the
    widest unsigned ints that tile it, OR-ed column by column (a reduction across a short row
    costs numpy a call per row; across the rows it is a few vector passes)."""
    size = next(s for s in (8, 4, 2, 1) if k % s == 0)
    v = flat.view(f"u{size}").reshape(n, k // size)
    acc = v[:, 0].copy()
    for j in range(1, k // size):
        acc |= v[:, j]
    return acc != 0


def _block_flags(lps: np.ndarray, chosen: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    n, k = lps.shape
    disorder, positive, heavy = out  # [n] bool views of the scan's columns, written in place
    flat = lps.reshape(-1)
    hit = np.empty(n * k, bool)
    tmp = np.empty(n * k, np.float32)  # one scratch buffer for both float passes
    with np.errstate(invalid="ignore", over="ignore"):
        hit[0] = False  # an entry above the one before it, within the row (NaN compares False)
        np.add(flat[:-1], np.float32(ORDER_TOL), out=tmp[1:])
        np.greater(flat[1:], tmp[1:], out=hit[1:])
        hit[::k] = False
        # the per-row passes only for a block that holds a finding (a sound block: one reduction)
        disorder[:] = _any_per_row(hit, n, k) if hit.any() else False
        np.greater(chosen, POSITIVE_LIMIT, out=positive)
        if not flat.max() <= POSITIVE_LIMIT:  # a value above the limit, or a NaN (max is NaN)
            np.greater(flat, POSITIVE_LIMIT, out=hit)
            positive |= _any_per_row(hit, n, k)
        # float32 sums of exp: on the bench's 2-core host (numpy 2.4, AVX2, no AVX-512) exp costs
        # 0.46 ms a 1 MiB block, exp2 0.75-1.2 ms and a multiply on top (an earlier session measured
        # exp2 at a third of exp: numpy dispatches them by the CPU's features). The sum only sorts rows (far
        # below the limit: sound; NaN, inf and near it: summed again exactly below), so which
        # function computes it never decides a verdict
        mass = np.exp(flat, out=tmp).reshape(n, k) @ np.ones(k, np.float32)  # NaN where a row holds a NaN
    odd = np.flatnonzero(np.isnan(mass))
    if len(odd):  # a value after a NaN gap is out of order too
        nan = np.isnan(lps[odd])
        disorder[odd] |= (nan[:, :-1] & ~nan[:, 1:]).any(1)
    near = np.flatnonzero(~(mass <= SUM_LIMIT - 1e-3))  # NaN, inf and sums near the limit: exactly
    heavy[:] = False
    if len(near):
        heavy[near] = row_mass(lps[near]) > SUM_LIMIT


def scan(reader, token_id: np.ndarray, logprob: np.ndarray, keep: np.ndarray | None = None) -> RowScan | None:
    """The scan of every token row of `reader` (None when it stores no top-k). keep: token rows
    whose top-k ids and logprobs to keep (RowScan.rows)."""
    if not reader.has_column("topk_logprob"):
        return None
    n = len(token_id)
    k = reader.layout.topk if reader.layout.topk else 0
    keep = np.unique(np.asarray(keep if keep is not None else (), dtype=np.int64))
    keep = keep[(keep >= 0) & (keep < n)]
    out = RowScan(
        np.full(n, np.nan, np.float32),
        np.zeros(n, bool),
        np.zeros(n, bool),
        np.zeros(n, bool),
        keep,
        np.zeros((len(keep), k), np.int32),
        np.zeros((len(keep), k), np.float32),
    )
    step = max(1, BLOCK_BYTES // max(1, 4 * k))
    chunk = reader.chunk_rows("topk_logprob")
    if chunk and chunk == reader.chunk_rows("topk_id"):  # whole chunks a block: each decoded once
        step = chunk * max(1, round(step / chunk))
    bufs = None  # one buffer per column, reused block after block
    # a window of a trace (window.py) cuts its blocks at the file's chunk edges within each run
    blocks = reader.blocks(step) if hasattr(reader, "blocks") else [(s, min(n, s + step)) for s in range(0, n, step)]
    for s, e in blocks:
        if bufs is None:
            ids, lps = reader.column("topk_id", slice(s, e)), reader.column("topk_logprob", slice(s, e))
            if lps.ndim != 2 or not lps.shape[1]:
                return None
            bufs = (np.empty((step,) + ids.shape[1:], ids.dtype), np.empty((step,) + lps.shape[1:], lps.dtype))
        else:
            ids = reader.column("topk_id", slice(s, e), out=bufs[0])
            lps = reader.column("topk_logprob", slice(s, e), out=bufs[1])
        pick(ids, lps, token_id[s:e], out.topk_lp[s:e])  # topk_lp starts NaN
        _flags(lps, logprob[s:e], (out.disorder[s:e], out.positive[s:e], out.heavy[s:e]))
        lo, hi = np.searchsorted(keep, (s, e))
        if hi > lo:
            out.kept_ids[lo:hi], out.kept_lps[lo:hi] = ids[keep[lo:hi] - s], lps[keep[lo:hi] - s]
    return out
