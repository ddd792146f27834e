"""One pass over a trace's [N, k] top-k columns, in blocks: what a diff needs of every row.

A diff reads the top-k ids and logprobs of every token row for two things: the chosen
token's own entry (to check the logprob column against it, sides.py) and the checks of what
the engine reported on every row (reported.py: order, sign, mass). Both are computed here
in one read, block by block, so neither column is held whole nor read twice:

  topk_lp    [N] the chosen token's entry in its row (NaN when absent)
  disorder   [N] an entry above the one before it by more than ORDER_TOL, or a value after a NaN
  positive   [N] the chosen logprob or a top-k logprob above POSITIVE_LIMIT
  heavy      [N] the row's probabilities (NaN entries left out) summing to more than SUM_LIMIT

The checks themselves live in tracekit/rowcheck.py. A trace whose writer stored them
(`/rowcheck`, with this tracekit's limits) is not read whole: its two 1-D columns give the same
arrays, and only the rows asked to be kept are read from the top-k columns (a million-row diff
reads 5 bytes a row instead of 160).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracekit import rowcheck
from tracekit.rowcheck import ORDER_TOL, flags, pick  # noqa: F401 (ORDER_TOL: tests read it here)

from .window import token_rows

BLOCK_BYTES = 1 << 20  # rows read at a time, per column (whole stored chunks: the store's are ~1 MiB)
STORED = ("rowcheck/topk_lp", "rowcheck/flags")  # what the writer stored of each row (tracekit/rowcheck.py)


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
    if reader.has_column(STORED[0]) and reader.has_column(STORED[1]):
        return _stored(reader, out, logprob)
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
        flags(lps, logprob[s:e], (out.disorder[s:e], out.positive[s:e], out.heavy[s:e]))
        lo, hi = np.searchsorted(keep, (s, e))
        if hi > lo:
            out.kept_ids[lo:hi], out.kept_lps[lo:hi] = ids[keep[lo:hi] - s], lps[keep[lo:hi] - s]
    return out


def _stored(reader, out: RowScan, logprob: np.ndarray) -> RowScan:
    """The scan from the checks the writer stored: the same arrays, the kept rows read alone."""
    out.topk_lp[:] = reader.column(STORED[0])
    out.disorder[:], out.positive[:], out.heavy[:] = rowcheck.unpack(reader.column(STORED[1]), logprob)
    if len(out.kept):
        out.kept_ids[:] = token_rows(reader, "topk_id", out.kept)
        out.kept_lps[:] = token_rows(reader, "topk_logprob", out.kept)
    return out
