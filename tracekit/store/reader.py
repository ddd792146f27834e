"""The lazy trace reader: the request table eagerly, token columns on demand.

Readers are picked by format_version; an older version is read by its own
reader and upgraded in memory by explicit functions; a newer one is a clear
error naming both versions.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import h5py
import numpy as np

from ..errors import SchemaVersionError, TraceFormatError
from ..schema import FORMAT, FORMAT_VERSION, Layout, RequestRecord, RequestTable, RunMeta, TokenColumns
from .columns import FIXED, RAGGED
from .journal import journal_path, read_journal, recover, writer_alive


def open_h5(path: str | os.PathLike) -> h5py.File:
    """Open a trace read-only, recovering a trace whose writer was killed.

    A writer that did not close its file leaves the SWMR write flag set; a plain
    open then refuses ("already open for write"). If the writer is still
    running, this is a live capture: open it as an SWMR reader. If it is gone,
    rebuild the trace from its write-ahead journal (`journal.recover`) and open
    the result. An SWMR open of a killed file is never attempted: it can retry
    a half-written metadata object forever.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TraceFormatError(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
    except OSError as plain_err:
        if "already open for write" not in str(plain_err):
            raise TraceFormatError(
                f"{path}: not a readable HDF5 file ({_first_line(plain_err)}); "
                "is it a tracekit trace? re-capture it or pass the right file"
            ) from None
    jpath = journal_path(path)
    try:
        meta, _ = read_journal(jpath)
    except OSError:
        meta = {}
    if meta and writer_alive(meta):
        try:
            return h5py.File(path, "r", swmr=True)
        except OSError as e:
            raise TraceFormatError(f"{path}: live trace could not be opened ({_first_line(e)})") from None
    if not meta:
        raise TraceFormatError(
            f"{path}: left open by a writer that did not close it, and its journal {jpath.name} is missing; "
            f"run `h5clear -s {path}` (Debian: hdf5-tools) and retry, or re-capture"
        )
    recover(path)
    return h5py.File(path, "r")


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _read_ragged(group: h5py.Group, name: str, n: int) -> np.ndarray:
    end = group[f"{name}_end"][:n].tolist()
    data = group[f"{name}_bytes"][: end[-1] if n else 0].tobytes()
    starts = [0] + end[:-1]
    out = np.empty(n, dtype=object)
    text = data.decode("utf-8")
    if not text:  # most ragged columns (error, history, prompt_text) are empty in most traces
        out[:] = ""
    elif len(text) == len(data):  # ASCII: byte offsets are character offsets, slice the str
        out[:] = [text[s:e] for s, e in zip(starts, end)]
    else:
        out[:] = [data[s:e].decode("utf-8") for s, e in zip(starts, end)]
    return out


def _read_v1(f: h5py.File, path: str) -> tuple[RunMeta, RequestTable]:
    req = f["requests"]
    # In a file whose writer died, columns can differ by the rows of a request
    # that was half written; the committed rows are those present in every column.
    n = min(req[c].shape[0] for c in list(FIXED) + [f"{r}_end" for r in RAGGED])
    cols = {}
    for name, (dt, _) in FIXED.items():
        a = req[name][:n]
        cols[name] = a.astype(str).astype(object) if dt.startswith("S") else a
    for name in RAGGED:
        cols[name] = _read_ragged(req, name, n)
    # Drop trailing rows whose tokens were not fully written (a kill mid-append).
    tok_rows = min(f["tokens"][c].shape[0] for c in f["tokens"])
    ends = cols["token_offset"] + cols["n_tokens"]
    p_ends = cols["prompt_offset"] + np.maximum(cols["prompt_len"], 0)
    good = (ends <= tok_rows) & (p_ends <= f["prompt/token_id"].shape[0])
    keep = int(np.argmin(good)) if not good.all() else n
    if keep < n:
        cols = {k: v[:keep] for k, v in cols.items()}
    table = RequestTable(**cols)
    a = f.attrs
    missing = [n for n in ("source", "run", "topk", "raw_logits", "vocab_size", "writer", "created_utc") if n not in a]
    if missing:
        raise TraceFormatError(
            f"{path}: missing root attribute {missing[0]!r}; the file is not a complete tracekit trace (re-capture it)"
        )
    try:
        layout = Layout(topk=int(a["topk"]), raw_logits=bool(a["raw_logits"]), vocab_size=int(a["vocab_size"]))
        meta = RunMeta(
            source=str(a["source"]),
            run=json.loads(a["run"]),
            layout=layout,
            format_version=int(a["format_version"]),
            writer=str(a["writer"]),
            created_utc=str(a["created_utc"]),
        )
    except KeyError as e:
        raise TraceFormatError(
            f"{path}: missing root attribute {e.args[0]!r}; the file is not a complete tracekit trace (re-capture it)"
        ) from None
    except (ValueError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path}: bad root attribute ({e})") from None
    return meta, table


# format_version -> reader. An older version is read by its own reader and
# upgraded in memory by the functions in _UPGRADES (none yet: v1 is the first).
_READERS: dict[int, Callable[[h5py.File, str], tuple[RunMeta, RequestTable]]] = {1: _read_v1}
_UPGRADES: dict[int, Callable[[RunMeta, RequestTable], tuple[RunMeta, RequestTable]]] = {}


def _check_header(f: h5py.File, path: str) -> int:
    fmt = f.attrs.get("format")
    if fmt is None:
        raise TraceFormatError(f"{path}: HDF5 file without a 'format' attribute: not a tracekit trace")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    if fmt != FORMAT:
        raise TraceFormatError(f"{path}: format is {fmt!r}, expected {FORMAT!r}: not a tracekit trace")
    if "format_version" not in f.attrs:
        raise TraceFormatError(f"{path}: missing attribute 'format_version'; the file is incomplete")
    version = int(f.attrs["format_version"])
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


class TraceReader:
    """A trace opened read-only. The request table is read eagerly (it is small);
    token columns are read lazily, per request or per column."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._f = open_h5(self.path)
        try:
            version = _check_header(self._f, self.path)
            try:
                meta, table = _READERS[version](self._f, self.path)
            except KeyError as e:
                raise TraceFormatError(
                    f"{self.path}: missing dataset ({_first_line(e)}); the file is not a complete tracekit trace"
                ) from None
            while meta.format_version < FORMAT_VERSION:
                meta, table = _UPGRADES[meta.format_version](meta, table)
        except BaseException:
            self._f.close()
            raise
        self.meta: RunMeta = meta
        self.requests: RequestTable = table

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
    def layout(self) -> Layout:
        return self.meta.layout

    @property
    def n_token_rows(self) -> int:
        if not len(self.requests):
            return 0
        return int(self.requests.token_offset[-1] + self.requests.n_tokens[-1])

    def has_column(self, name: str) -> bool:
        return name in self._f["tokens"]

    def record(self, i: int) -> RequestRecord:
        return self.requests.record(i)

    def tokens(self, i: int, full_logits: bool = False) -> TokenColumns:
        """Token columns of request row i (reads only that request's rows)."""
        s = int(self.requests.token_offset[i])
        e = s + int(self.requests.n_tokens[i])
        tok = self._f["tokens"]

        def get(name):
            return tok[name][s:e] if name in tok else None

        return TokenColumns(
            get("token_id"),
            get("logprob"),
            get("t_arrival_s"),
            get("topk_id"),
            get("topk_logprob"),
            get("topk_logit"),
            get("logits") if full_logits else None,
        )

    def prompt_ids(self, i: int) -> np.ndarray | None:
        """Prompt token ids of row i, or None when the prompt length is unknown."""
        n = int(self.requests.prompt_len[i])
        if n < 0:
            return None
        s = int(self.requests.prompt_offset[i])
        return self._f["prompt/token_id"][s : s + n]

    def column(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A whole token column (or a row range of it) as one numpy array."""
        tok = self._f["tokens"]
        if name not in tok:
            raise TraceFormatError(
                f"{self.path}:/tokens/{name}: column not in this trace (columns: {', '.join(sorted(tok))})"
            )
        ds = tok[name]
        n = self.n_token_rows
        rows = rows or slice(0, n)
        out = np.empty((len(range(*rows.indices(n))),) + ds.shape[1:], dtype=ds.dtype)
        if len(out):
            ds.read_direct(out, np.s_[rows])
        return out

    def columns(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {n: self.column(n) for n in names}


def read_token_rows(reader: TraceReader, name: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (any order, repeats allowed) of token column `name`, as one array.

    Used by the analysis to fetch top-k rows at divergence positions only,
    instead of reading whole [N, k] columns. h5py's fancy selection wants
    sorted unique indices, so read those once and scatter back.
    """
    tok = reader._f["tokens"]
    if name not in tok:
        raise TraceFormatError(
            f"{reader.path}:/tokens/{name}: column not in this trace (columns: {', '.join(sorted(tok))})"
        )
    ds = tok[name]
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
    if span <= 8 * len(uniq):
        got = ds[int(uniq[0]) : int(uniq[-1]) + 1][uniq - uniq[0]]
    else:
        got = ds[uniq]
    return got[inverse]


def prompt_column(reader: TraceReader) -> np.ndarray:
    """All prompt token ids of a trace, concatenated (index with prompt_offset/prompt_len)."""
    ds = reader._f["prompt/token_id"]
    out = np.empty(ds.shape, dtype=ds.dtype)
    if len(out):
        ds.read_direct(out)
    return out
