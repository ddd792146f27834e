"""A diff that streams: the pairs judged a chunk at a time, never both traces in memory.

Every verdict is a function of one pair's rows (classify.py, reported.py), so a diff can
take the pairs in chunks of about `positions` token rows, in the order of the result (A's
keys, then keys only in B), read each chunk's rows of both traces (window.py: a window per
side, a few runs of each file), judge it exactly as a whole diff judges its pairs, and keep
only the [P] result columns. What is not a function of one pair is computed once from the
request tables (the pairing and its checks, dtypes, EOS ids, the grids, context notes) or
reduced over the chunks (the calibrated flip test's trials). The result is the whole diff's,
column for column (tests/analyze/test_stream.py); peak memory is one chunk's, whatever the
traces' length (bench/diff_bench.py --scaling).

Not streamed (compare.diff reads them whole): a teacher-forced side (its rows are read
through their top-k) and the checks against a third trace (--teacher, --reference). The
prompt ids of both traces are read whole (an input is far smaller than its outputs' top-k).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tracekit.store import TraceReader, prompt_column

from .align import Alignment, align, pair_keys
from .positions import with_scans
from .sides import Side, window_side
from .window import Window, runs, sub_table

POSITIONS = 1 << 20  # token rows a chunk (each side): a chunk's columns stay well under 100 MB


def streams(ra: TraceReader, rb: TraceReader, positions: int | None, *others) -> bool:
    """Whether a diff of ra and rb streams: both HTTP traces, no third trace, one longer than a chunk."""
    if not positions or any(o is not None for o in others):
        return False
    if ra.meta.source != "http" or rb.meta.source != "http":
        return False
    return max(ra.n_token_rows, rb.n_token_rows) > positions


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The request level of a whole diff: what context_notes and side_dtypes read of it."""

    a: Side
    b: Side
    keys: np.ndarray
    row_a: np.ndarray
    row_b: np.ndarray
    n_a: np.ndarray
    n_b: np.ndarray


def pairs(a: Side, b: Side) -> Pairs:
    """The pairs of two header sides (sides.header_side), checked as align checks them."""
    keys, row_a, row_b = pair_keys(a, b)

    def n(side, rows):
        return np.where(rows >= 0, side.table.n_tokens[np.maximum(rows, 0)], 0).astype(np.int64)

    return Pairs(a, b, keys, row_a, row_b, n(a, row_a), n(b, row_b))


def chunks(p: Pairs, positions: int) -> list[tuple[int, int]]:
    """[p0, p1) ranges of pairs of about `positions` token rows a side each (at least one pair)."""
    size = np.maximum(p.n_a, p.n_b)
    ends, start, total = [], 0, 0
    for i, n in enumerate(size.tolist()):
        if total and total + n > positions:
            ends.append((start, i))
            start, total = i, 0
        total += n
    ends.append((start, len(size)))
    return ends


def _window(side: Side, rows: np.ndarray, keys: np.ndarray, prompt: np.ndarray) -> Side:
    """side over the request rows `rows` (-1: missing) of a chunk of pairs with `keys`."""
    t = side.table
    want = rows[rows >= 0]
    amb = [k for k in keys.tolist() if k in side.ambiguous]
    if amb:  # a key answered ok more than once: every answer is shown (align._ambiguous_reason)
        extra = np.flatnonzero(np.isin(t.key, amb) & (t.status == "ok"))
        want = np.concatenate([want, extra])
    if not len(want):  # a chunk of keys all missing on this side: one row (not selected) to index
        want = np.zeros(1, np.int64)
    req = np.unique(want)  # sorted file rows: the window keeps the file's order
    off = t.token_offset[req].astype(np.int64)
    starts, ends = runs(off, t.n_tokens[req].astype(np.int64))
    win = Window(side.reader, starts, ends)
    table = sub_table(t, req, win)
    cols = {n: win.column(n) for n in ("token_id", "logprob")}
    sel = np.searchsorted(req, np.sort(rows[rows >= 0]))  # the selected rows, in the window's table
    return window_side(side, sel, prompt, cols, table, win, req)


def judge_chunks(p: Pairs, positions: int, judge: Callable[[Alignment, slice], dict], gaps: Callable | None = None):
    """(the result columns [P] of every pair, judged a chunk at a time by judge(alignment, the
    chunk's slice of the pairs); with `gaps`, gaps(alignment, its columns) of the chunks merged
    into one (merge_gaps), else None)."""
    prompts = (prompt_column(p.a.reader), prompt_column(p.b.reader))
    parts, gap_parts = [], []
    for p0, p1 in chunks(p, positions):
        wa = _window(p.a, p.row_a[p0:p1], p.keys[p0:p1], prompts[0])
        wb = _window(p.b, p.row_b[p0:p1], p.keys[p0:p1], prompts[1])
        al = with_scans(align(wa, wb, whole=False))
        assert al.keys.tolist() == p.keys[p0:p1].tolist(), "a chunk pairs the whole diff's keys"
        cols = judge(al, slice(p0, p1))
        parts.append(cols)
        if gaps is not None:
            gap_parts.append(gaps(al, cols))
        del al, wa, wb  # one chunk's rows at a time
    out = {k: np.concatenate([c[k] for c in parts]) for k in parts[0]}
    return out, (merge_gaps(gap_parts) if gap_parts else None)


def merge_gaps(parts: list):
    """One flip_rate.PositionGaps of the chunks' (pair indices shifted to the whole diff's)."""
    first = parts[0]
    sizes = [len(g.flipped) for g in parts]
    shift = np.cumsum([0] + sizes[:-1])
    cat = {}
    for f in dataclasses.fields(first):
        vals = [getattr(g, f.name) for g in parts]
        if vals[0] is None:
            cat[f.name] = None
        elif f.name == "pair":
            cat[f.name] = np.concatenate([v + s for v, s in zip(vals, shift.tolist())])
        else:
            cat[f.name] = np.concatenate(vals)
    return dataclasses.replace(first, **cat)
