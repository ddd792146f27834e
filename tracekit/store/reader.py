"""The lazy trace reader: the request table eagerly, token columns on demand.

Readers are picked by format_version; an older version is read by its own
reader and upgraded in memory by explicit functions; a newer one is a clear
error naming both versions. Every check a version's reader makes happens when
the file is opened (`v1.py`); a later read that hits damaged data (a corrupt
chunk) is a TraceFormatError too, never an h5py traceback.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable

import h5py
import numpy as np

from .. import rowcheck
from ..errors import SchemaVersionError, TraceFormatError, TracekitError
from ..schema import FORMAT, FORMAT_VERSION, Layout, RequestRecord, RequestTable, RunMeta, TokenColumns
from .columns import ROWCHECK
from .journal import journal_path, read_journal, writer_alive
from .recovery import recover
from .v1 import H5_ERRORS, Opened, damage, dataset_id, first_line, int_attr, read_all, read_v1, root_attrs, str_attr


def _open(path: str, swmr: bool = False) -> h5py.File:
    # No chunk cache by default: whole-column reads then go straight into the caller's array.
    return h5py.File(path, "r", swmr=swmr, rdcc_nbytes=0)


def open_h5(path: str | os.PathLike) -> h5py.File:
    """Open a trace read-only, recovering a trace whose writer was killed.

    A writer that did not close its file leaves the SWMR write flag set; a plain
    open then refuses ("already open for write"). If the writer is still
    running, this is a live capture: open it as an SWMR reader. If it is gone,
    rebuild the trace from its write-ahead journal (`recovery.recover`) and open
    the result. An SWMR open of a killed file is never attempted: it can retry
    a half-written metadata object forever.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TraceFormatError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceFormatError(f"{path}: a directory, not a trace file")
    try:
        return _open(path)
    except H5_ERRORS as plain_err:
        if "already open for write" not in str(plain_err):
            raise TraceFormatError(
                f"{path}: not a readable HDF5 file ({first_line(plain_err)}); "
                "is it a tracekit trace? re-capture it or pass the right file"
            ) from None
    jpath = journal_path(path)
    try:
        meta, _ = read_journal(jpath)
    except (OSError, ValueError, KeyError, TypeError):  # no journal, or a damaged first record
        meta = {}
    if meta and writer_alive(meta, jpath):
        try:
            return _open(path, swmr=True)
        except H5_ERRORS as e:
            raise TraceFormatError(f"{path}: live trace could not be opened ({first_line(e)})") from None
    if not meta:
        raise TraceFormatError(
            f"{path}: left open by a writer that did not close it, and its journal {jpath.name} is missing "
            f"or unreadable; run `h5clear -s {path}` (Debian: hdf5-tools) and retry, or re-capture"
        )
    try:
        recover(path)
    except FileNotFoundError:  # another reader recovered it first and removed the journal
        pass
    except TracekitError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TraceFormatError(
            f"{path}: its writer was killed and its journal {jpath.name} could not rebuild it "
            f"({type(e).__name__}: {first_line(e)}); re-capture it"
        ) from None
    with damaged(path, ""):
        return _open(path)


# format_version -> reader of the request table. An older version is read by its
# own reader and upgraded in memory by the functions in _UPGRADES (none yet: v1 is the first).
_READERS: dict[int, Callable[[h5py.File, dict, str, bool], Opened]] = {1: read_v1}
_UPGRADES: dict[int, Callable[[RunMeta, RequestTable], tuple[RunMeta, RequestTable]]] = {}


def _check_header(attrs: dict, path: str) -> int:
    if "format" not in attrs:
        raise TraceFormatError(f"{path}: HDF5 file without a 'format' attribute: not a tracekit trace")
    fmt = str_attr(attrs, "format", path)
    if fmt != FORMAT:
        raise TraceFormatError(f"{path}: format is {fmt!r:.60}, expected {FORMAT!r}: not a tracekit trace")
    if "format_version" not in attrs:
        raise TraceFormatError(f"{path}: missing attribute 'format_version'; the file is incomplete")
    version = int_attr(attrs, "format_version", path)
    if version > FORMAT_VERSION:
        raise SchemaVersionError(
            f"{path}: trace format version {version} is newer than this tracekit reads "
            f"(version {FORMAT_VERSION}); upgrade tracekit (pip install -U tracekit)"
        )
    if version not in _READERS:
        raise SchemaVersionError(
            f"{path}: unknown trace format version {version} (this tracekit reads {sorted(_READERS)})"
        )
    return version


@contextlib.contextmanager
def damaged(path: str, where: str, ds: h5py.Dataset | None = None):
    """Turn h5py's errors on a damaged file into one TraceFormatError that says where (a chunk
    of dataset `ds` that fails its checksum says so)."""
    try:
        yield
    except TracekitError:
        raise
    except H5_ERRORS as e:
        raise damage(path, where, e, None if ds is None else ds.id) from None


class TraceReader:
    """A trace opened read-only. The request table is read eagerly (it is small) and
    checked whole; token columns are read lazily, per request or per column."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._f = open_h5(self.path)
        try:
            with damaged(self.path, ""):
                attrs = root_attrs(self._f)
                version = _check_header(attrs, self.path)
                opened = _READERS[version](self._f, attrs, self.path, self.live)
            meta, table, self._tok, self._prompt = opened.meta, opened.table, opened.tokens, opened.prompt
            while meta.format_version < FORMAT_VERSION:
                meta, table = _UPGRADES[meta.format_version](meta, table)
        except BaseException:
            self._f.close()
            raise
        self.meta: RunMeta = meta
        self.requests: RequestTable = table
        with damaged(self.path, "/rowcheck"):
            self._checks = _row_checks(self._f, attrs, self.path, self.n_token_rows, bool(meta.checksum), self.live)

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._f.id.valid:
            self._f.close()

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def live(self) -> bool:
        """Opened while its writer runs (an SWMR reader): the last rows may still be in flight."""
        return bool(self._f.swmr_mode)

    @property
    def layout(self) -> Layout:
        return self.meta.layout

    @property
    def n_token_rows(self) -> int:
        if not len(self.requests):
            return 0
        return int(self.requests.token_offset[-1] + self.requests.n_tokens[-1])

    def has_column(self, name: str) -> bool:
        """A token column, or one of the stored row checks ("rowcheck/topk_lp", "rowcheck/flags":
        present when the writer stored them with this tracekit's limits, tracekit/rowcheck.py)."""
        return name in self._tok or name in self._checks

    def chunk_rows(self, name: str) -> int:
        """Rows a stored chunk of token column `name` holds (0 when not chunked): a reader of
        blocks reads whole chunks, each decoded (checksummed) once."""
        chunks = self._dataset(name).chunks
        return int(chunks[0]) if chunks else 0

    def _dataset(self, name: str) -> h5py.Dataset:
        ds = self._tok.get(name)
        if ds is None:
            ds = self._checks.get(name)
        if ds is None:
            raise TraceFormatError(
                f"{self.path}:/tokens/{name}: column not in this trace (columns: {', '.join(sorted(self._tok))})"
            )
        return ds

    def record(self, i: int) -> RequestRecord:
        return self.requests.record(i)

    def tokens(self, i: int, full_logits: bool = False) -> TokenColumns:
        """Token columns of request row i (reads only that request's rows)."""
        s = int(self.requests.token_offset[i])
        e = s + int(self.requests.n_tokens[i])
        cols = {}
        for n, ds in self._tok.items():
            if n != "logits" or full_logits:
                with damaged(self.path, f"/tokens/{n} (rows {s}:{e})", ds):
                    cols[n] = _read_rows(ds, s, e)
        return TokenColumns(**cols)

    def prompt_ids(self, i: int) -> np.ndarray | None:
        """Prompt token ids of row i, or None when the prompt length is unknown."""
        n = int(self.requests.prompt_len[i])
        if n < 0:
            return None
        s = int(self.requests.prompt_offset[i])
        with damaged(self.path, f"/prompt/token_id (rows {s}:{s + n})", self._prompt):
            return _read_rows(self._prompt, s, s + n)

    def column(self, name: str, rows: slice | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """A whole token column (or a row range of it) as one numpy array. out: a C-contiguous
        array of the column's dtype and at least as many rows to read into (a reader of many
        blocks reuses one buffer instead of faulting in fresh pages each block); the result is
        its first rows."""
        ds = self._dataset(name)
        n = self.n_token_rows
        start, stop, step = (rows or slice(0, n)).indices(n)
        with damaged(self.path, f"/{name}" if "/" in name else f"/tokens/{name}", ds):
            if step == 1:
                return _read_rows(ds, start, max(start, stop), out)
            return ds[start:stop:step]

    def columns(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {n: self.column(n) for n in names}

    def verify(self, block_bytes: int = 64 << 20) -> int:
        """Read every token and prompt row once, in blocks: a damaged chunk (which the
        checks at open cannot see) becomes a TraceFormatError now rather than in the
        middle of a diff. Returns the bytes read."""
        total = 0
        named = [(f"/tokens/{n}", ds) for n, ds in self._tok.items()] + [("/prompt/token_id", self._prompt)]
        named += [(f"/{n}", ds) for n, ds in self._checks.items()]
        for where, ds in named:
            n = ds.shape[0]
            step = max(1, block_bytes // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))))
            with damaged(self.path, where, ds):
                for s in range(0, n, step):
                    total += _read_rows(ds, s, min(n, s + step)).nbytes
        return total


def _row_checks(
    f: h5py.File, attrs: dict, path: str, n_rows: int, checksum: bool, live: bool
) -> dict[str, h5py.Dataset]:
    """The stored row checks by column name ("rowcheck/flags", ...), or none: a trace written
    without them (older, or no top-k), with other limits than this tracekit's, or live (its
    writer stores them in batches: they may lag its rows), and a diff computes them from the
    top-k columns. In a closed trace, stored ones that do not cover every token row are damage."""
    stamp = attrs.get("rowcheck")
    if isinstance(stamp, (bytes, np.bytes_)):
        stamp = stamp.decode("utf-8", "replace")
    if "rowcheck" not in f or stamp != rowcheck.LIMITS:
        return {}
    group = f["rowcheck"]
    out = {}
    for name, dt in ROWCHECK.items():
        dsid = dataset_id(group, name, dt, 1, path, checksum=checksum)
        if dsid.shape[0] < n_rows and live:
            return {}
        if dsid.shape[0] < n_rows:
            got = f"{dsid.shape[0]} rows for {n_rows} token rows"
            raise TraceFormatError(f"{path}:/rowcheck/{name}: {got}; the file is damaged, re-capture it")
        out[f"rowcheck/{name}"] = h5py.Dataset(dsid)
    return out


def _read_rows(ds: h5py.Dataset, start: int, stop: int, into: np.ndarray | None = None) -> np.ndarray:
    """Rows [start, stop) of a dataset through h5py's low-level read (a tenth of the
    high-level slice's overhead, which a per-request read pays seven times)."""
    if into is not None:
        if into.dtype != ds.dtype or into.shape[1:] != ds.shape[1:] or len(into) < stop - start:
            want = f"[>= {stop - start}, {ds.shape[1:]}] {ds.dtype}"
            raise ValueError(f"out: expected {want}, got {into.shape} {into.dtype}")
        out = into[: stop - start]
    elif start == 0 and stop == ds.shape[0]:
        return read_all(ds.id)
    else:
        out = np.empty((stop - start,) + ds.shape[1:], dtype=ds.dtype)
    if len(out):
        fspace = ds.id.get_space()
        fspace.select_hyperslab((start,) + (0,) * (ds.ndim - 1), out.shape)
        ds.id.read(h5py.h5s.create_simple(out.shape), fspace, out)
    return out


def read_token_rows(reader: TraceReader, name: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (any order, repeats allowed) of token column `name`, as one array.

    Used by the analysis to fetch top-k rows at divergence positions only,
    instead of reading whole [N, k] columns. h5py's fancy selection wants
    sorted unique indices, so read those once and scatter back.
    """
    ds = reader._dataset(name)
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return np.empty((0,) + ds.shape[1:], dtype=ds.dtype)
    uniq, inverse = np.unique(rows, return_inverse=True)
    if uniq[0] < 0 or uniq[-1] >= reader.n_token_rows:
        raise TraceFormatError(
            f"{reader.path}:/tokens/{name}: row {int(uniq[-1])} out of range (the trace has {reader.n_token_rows} rows)"
        )
    # One slab read when the rows are dense enough; a point selection otherwise.
    span = int(uniq[-1] - uniq[0] + 1)
    with damaged(reader.path, f"/tokens/{name}", ds):
        if span <= 8 * len(uniq):
            got = _read_rows(ds, int(uniq[0]), int(uniq[-1]) + 1)[uniq - uniq[0]]
        else:
            got = ds[uniq]
    return got[inverse]


def prompt_column(reader: TraceReader) -> np.ndarray:
    """All prompt token ids of a trace, concatenated (index with prompt_offset/prompt_len)."""
    with damaged(reader.path, "/prompt/token_id", reader._prompt):
        return read_all(reader._prompt.id)
