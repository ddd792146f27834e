"""A trace seen through a window of its requests: what a streaming diff compares at a time.

A diff of traces too large to hold whole (10M positions: ~2.5 GB of top-k columns a trace)
runs over chunks of pairs (stream.py); each chunk's sides are windows: the chunk's request
rows as a request table of their own, their token rows read as a few runs of the file
(requests written one after the other are one run), their offsets rebased into the window.
Everything downstream (align, the top-k pass, classify, the row checks) reads a window as it
reads a whole trace: `Window` answers what they ask of a TraceReader (column, has_column,
chunk_rows, layout, meta, path, n_token_rows) in window rows, and `rows()` reads any rows of
a column by window row. Nothing here judges; nothing here writes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tracekit.schema import RequestTable
from tracekit.store import TraceReader, read_token_rows

GAP_ROWS = 1 << 12  # two runs this close are read as one (the rows between: read, never compared)


class Window:
    """Token rows [0, n) of a window: the file's rows runs[0], then runs[1], ... (each [start, end))."""

    def __init__(self, reader: TraceReader, starts: np.ndarray, ends: np.ndarray):
        self.reader, self.path, self.meta = reader, reader.path, reader.meta
        self._fs, self._fe = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        self._ws = np.cumsum(self._fe - self._fs) - (self._fe - self._fs)  # each run's first window row
        self.n_token_rows = int((self._fe - self._fs).sum())

    @property
    def layout(self):
        return self.reader.layout

    def has_column(self, name: str) -> bool:
        return self.reader.has_column(name)

    def chunk_rows(self, name: str) -> int:
        return self.reader.chunk_rows(name)

    def to_file(self, rows: np.ndarray) -> np.ndarray:
        """File rows of window rows."""
        rows = np.asarray(rows, dtype=np.int64)
        i = np.searchsorted(self._ws, rows, side="right") - 1
        return self._fs[i] + rows - self._ws[i]

    def column(self, name: str, rows: slice | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Window rows [start, stop) of a token column (all by default), as TraceReader.column."""
        start, stop, step = (rows or slice(0, self.n_token_rows)).indices(self.n_token_rows)
        assert step == 1, "a window reads row ranges"
        empty = self.reader.column(name, slice(0, 0))
        dest = np.empty((max(0, stop - start),) + empty.shape[1:], empty.dtype) if out is None else out
        for fs, fe, ws in zip(self._fs.tolist(), self._fe.tolist(), self._ws.tolist()):
            a, b = max(start, ws), min(stop, ws + fe - fs)  # this run's part of [start, stop)
            if a < b:
                self.reader.column(name, slice(fs + a - ws, fs + b - ws), out=dest[a - start : b - start])
        return dest[: max(0, stop - start)]

    def blocks(self, step: int) -> list[tuple[int, int]]:
        """Window row ranges of at most `step` rows whose file rows start at multiples of `step`
        (rowscan reads whole stored chunks a block, each decoded once) within each run."""
        out = []
        for fs, fe, ws in zip(self._fs.tolist(), self._fe.tolist(), self._ws.tolist()):
            for s in range(fs - fs % step, fe, step):
                out.append((ws + max(s, fs) - fs, ws + min(s + step, fe) - fs))
        return out

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Window rows `rows` (any order) of token column `name` (store.read_token_rows)."""
        return read_token_rows(self.reader, name, self.to_file(rows))


def token_rows(reader, name: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of a token column of a trace or a window (each in its own rows)."""
    if isinstance(reader, Window):
        return reader.rows(name, rows)
    return read_token_rows(reader, name, rows)


def runs(offsets: np.ndarray, lengths: np.ndarray, gap: int = GAP_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """([R] starts, [R] ends) of the file runs covering requests at sorted `offsets`: one run
    while the next request starts within `gap` rows of where the run ends."""
    if not len(offsets):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends = offsets + lengths
    reach = np.maximum.accumulate(ends)
    new = np.concatenate([[True], offsets[1:] > reach[:-1] + gap])
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:], [len(offsets)]]) - 1
    return offsets[first].astype(np.int64), reach[last].astype(np.int64)


def sub_table(table: RequestTable, rows: np.ndarray, window: Window) -> RequestTable:
    """The request rows `rows` (sorted file request rows) as a table of their own, their
    token offsets in `window`'s rows (prompt offsets stay the file's: the prompt column is read
    whole, see stream.py)."""
    cols = {f.name: getattr(table, f.name)[rows] for f in dataclasses.fields(table)}
    off = cols["token_offset"].astype(np.int64)
    i = np.searchsorted(window._fs, off, side="right") - 1
    cols["token_offset"] = window._ws[i] + off - window._fs[i]
    return RequestTable(**cols)
