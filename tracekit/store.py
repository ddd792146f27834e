"""HDF5 store for traces: an append-only SWMR writer and a lazy reader.

Layout (docs/format.md has every dataset): root attributes, `/requests/*`
columns (one row a request; strings as ragged UTF-8 `<name>_bytes` + `<name>_end`
pairs), `/tokens/*` columns (one row a position), `/prompt/token_id`.

Crash safety: the file is created under a temporary name, every dataset is
created chunked and resizable, SWMR mode is switched on, and only then is the
file renamed into place. After each appended request (or batch) the whole file
is flushed, so a writer killed with SIGKILL leaves a file that opens (with the
SWMR fallback in `open_h5`) and holds every flushed request. This module is the
only one that imports h5py.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import h5py
import numpy as np

from . import __version__
from .errors import SchemaVersionError, TraceFormatError
from .schema import FORMAT, FORMAT_VERSION, Layout, RequestRecord, RequestTable, RunMeta, TokenColumns

# name -> (numpy dtype, default) of fixed-width request columns.
_FIXED = {
    "prompt_hash": ("S64", b""), "status": ("S9", b""), "http_status": ("<i2", -1),
    "finish_reason": ("S16", b""), "cached_tokens": ("<i4", -1), "prompt_len": ("<i4", -1),
    "t_sent_s": ("<f8", np.nan), "t_first_token_s": ("<f8", np.nan), "t_done_s": ("<f8", np.nan),
    "dtype": ("S8", b""), "token_offset": ("<i8", 0), "n_tokens": ("<i4", 0), "prompt_offset": ("<i8", 0),
}
_RAGGED = ("key", "error", "history", "params", "prompt_text")
_REQ_CHUNK = 256
_TOK_CHUNK_ROWS = 1 << 14    # 1-D token columns: 16K rows a chunk (64 KiB of int32)
_TOPK_CHUNK_BYTES = 1 << 18  # [N, k] columns: about 256 KiB a chunk


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def open_h5(path: str | os.PathLike) -> h5py.File:
    """Open a trace read-only; fall back to SWMR for a file whose writer died.

    A writer killed mid-run leaves the SWMR write flag set; a plain open then
    refuses ("already open for write"), an SWMR-read open works and sees every
    flushed row.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TraceFormatError(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
    except OSError as plain_err:
        # Only a file left "open for write" by a dead SWMR writer gets the SWMR
        # retry: an SWMR open of a truncated file retries its metadata reads
        # for a long time instead of failing.
        if "already open for write" not in str(plain_err):
            raise TraceFormatError(
                f"{path}: not a readable HDF5 file ({_first_line(plain_err)}); "
                "is it a tracekit trace? re-capture it or pass the right file") from None
        try:
            return h5py.File(path, "r", swmr=True)
        except OSError:
            raise TraceFormatError(
                f"{path}: not a readable HDF5 file ({_first_line(plain_err)}); "
                "is it a tracekit trace? re-capture it or pass the right file") from None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


class TraceWriter:
    """Append requests to a new trace. Use as a context manager.

    `append` writes one request (its tokens and prompt ids) and flushes the file
    unless `flush=False`; `flush()` makes everything appended so far durable.
    """

    def __init__(self, path: str | os.PathLike, meta: RunMeta, expected_tokens: int | None = None):
        # expected_tokens (a hint) shrinks chunks for small traces: a chunk is
        # allocated whole, so a 500-token trace should not carry 256 KiB chunks.
        self._chunk_cap = max(64, int(expected_tokens)) if expected_tokens else None
        self.path = Path(path)
        self.meta = meta
        self.layout = meta.layout
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = h5py.File(tmp, "w", libver="latest")
        self._init_layout()
        self._f.swmr_mode = True
        self._f.flush()
        os.replace(tmp, self.path)  # the final name only ever holds a valid file
        self.n_requests = 0
        self.n_tokens = 0
        self.n_prompt = 0

    # -- creation ---------------------------------------------------------
    def _init_layout(self) -> None:
        f, m = self._f, self.meta
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["writer"] = f"tracekit {__version__}"
        f.attrs["created_utc"] = m.created_utc or _utc_now()
        f.attrs["source"] = m.source
        f.attrs["run"] = json.dumps(m.run, sort_keys=True)
        f.attrs["topk"] = m.layout.topk
        f.attrs["raw_logits"] = int(m.layout.raw_logits)
        f.attrs["vocab_size"] = m.layout.vocab_size
        req = f.create_group("requests")
        for name, (dt, _) in _FIXED.items():
            req.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(_REQ_CHUNK,))
        for name in _RAGGED:
            req.create_dataset(f"{name}_bytes", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 12,))
            req.create_dataset(f"{name}_end", shape=(0,), maxshape=(None,), dtype="<i8", chunks=(_REQ_CHUNK,))
        tok = f.create_group("tokens")
        for name, dt in (("token_id", "<i4"), ("logprob", "<f4"), ("t_arrival_s", "<f8")):
            tok.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(self._rows(_TOK_CHUNK_ROWS),))
        k = max(m.layout.topk, 1)
        rows = self._rows(max(256, _TOPK_CHUNK_BYTES // (4 * k)))
        cols = [("topk_id", "<i4"), ("topk_logprob", "<f4")] + ([("topk_logit", "<f4")] if m.layout.raw_logits else [])
        for name, dt in cols:
            tok.create_dataset(name, shape=(0, m.layout.topk), maxshape=(None, m.layout.topk), dtype=dt,
                               chunks=(rows, k) if m.layout.topk else None)
        if m.layout.vocab_size:
            v = m.layout.vocab_size
            tok.create_dataset("logits", shape=(0, v), maxshape=(None, v), dtype="<f4",
                               chunks=(self._rows(max(1, (1 << 18) // (4 * v))), v), compression="gzip",
                               compression_opts=1, shuffle=True)
        f.create_group("prompt").create_dataset("token_id", shape=(0,), maxshape=(None,), dtype="<i4",
                                                chunks=(self._rows(_TOK_CHUNK_ROWS),))

    def _rows(self, default: int) -> int:
        return min(default, self._chunk_cap) if self._chunk_cap else default

    # -- appending --------------------------------------------------------
    @staticmethod
    def _extend(ds: h5py.Dataset, values: np.ndarray) -> None:
        n = ds.shape[0]
        if len(values) == 0:
            return
        ds.resize(n + len(values), axis=0)
        ds[n:] = values

    def append(self, record: RequestRecord, tokens: TokenColumns | None = None,
               prompt_ids: Sequence[int] | np.ndarray | None = None, flush: bool = True) -> int:
        """Write one request row with its token rows; returns its row index."""
        lay = self.layout
        tokens = tokens if tokens is not None else TokenColumns.empty(lay.topk, lay.raw_logits, lay.vocab_size)
        tokens = tokens.padded_to(lay.topk)
        if lay.raw_logits and tokens.topk_logit is None and len(tokens):
            tokens = TokenColumns(tokens.token_id, tokens.logprob, tokens.t_arrival_s, tokens.topk_id,
                                  tokens.topk_logprob, np.full(tokens.topk_id.shape, np.nan, np.float32),
                                  tokens.logits)
        if lay.vocab_size and len(tokens) and (tokens.logits is None or tokens.logits.shape[1] != lay.vocab_size):
            raise ValueError(f"{self.path}: this trace stores full logits of width {lay.vocab_size}; "
                             f"got {None if tokens.logits is None else tokens.logits.shape}")
        tok = self._f["tokens"]
        for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob"):
            self._extend(tok[name], getattr(tokens, name))
        if lay.raw_logits:
            self._extend(tok["topk_logit"], tokens.topk_logit)
        if lay.vocab_size:
            self._extend(tok["logits"], tokens.logits)
        pids = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int32)
        self._extend(self._f["prompt/token_id"], pids)

        prompt_len = record.prompt_len if record.prompt_len >= 0 else (len(pids) if prompt_ids is not None else -1)
        row = {
            "prompt_hash": record.prompt_hash.encode(), "status": record.status.encode(),
            "http_status": record.http_status, "finish_reason": record.finish_reason.encode()[:16],
            "cached_tokens": record.cached_tokens, "prompt_len": prompt_len,
            "t_sent_s": record.t_sent_s, "t_first_token_s": record.t_first_token_s, "t_done_s": record.t_done_s,
            "dtype": record.dtype.encode()[:8], "token_offset": self.n_tokens, "n_tokens": len(tokens),
            "prompt_offset": self.n_prompt,
        }
        req = self._f["requests"]
        for name, (dt, _) in _FIXED.items():
            self._extend(req[name], np.array([row[name]], dtype=dt))
        for name in _RAGGED:
            data = np.frombuffer(str(getattr(record, name)).encode("utf-8"), dtype=np.uint8)
            end = req[f"{name}_end"]
            prev = int(end[-1]) if end.shape[0] else 0
            self._extend(req[f"{name}_bytes"], data)
            self._extend(end, np.array([prev + len(data)], dtype="<i8"))
        self.n_tokens += len(tokens)
        self.n_prompt += len(pids)
        self.n_requests += 1
        if flush:
            self.flush()
        return self.n_requests - 1

    def append_many(self, items: Sequence[tuple], flush: bool = True) -> int:
        """Write several requests, `(record, tokens|None, prompt_ids|None)` each, with one
        resize + write per dataset: a group commit. Appending costs ~25 dataset writes
        whatever its size, so a capture at high concurrency writes everything that
        finished while the previous write ran in one go. Returns the rows written.
        (Traces with full-vocabulary logits go through `append`, one request at a time.)"""
        lay = self.layout
        if not items or lay.vocab_size:
            for rec, toks, pids in items:
                self.append(rec, toks, pids, flush=flush)
            return len(items)
        empty = TokenColumns.empty(lay.topk, lay.raw_logits, lay.vocab_size)
        cols = {n: [] for n in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit")}
        rows = {name: [] for name in _FIXED}
        ragged = {name: [] for name in _RAGGED}
        all_pids = []
        n_tok, n_prompt = self.n_tokens, self.n_prompt
        for rec, toks, prompt_ids in items:
            toks = (toks if toks is not None else empty).padded_to(lay.topk)
            for name in cols:
                if name == "topk_logit":
                    if lay.raw_logits:
                        cols[name].append(toks.topk_logit if toks.topk_logit is not None
                                          else np.full(toks.topk_id.shape, np.nan, np.float32))
                else:
                    cols[name].append(getattr(toks, name))
            pids = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int32)
            all_pids.append(pids)
            plen = rec.prompt_len if rec.prompt_len >= 0 else (len(pids) if prompt_ids is not None else -1)
            row = {"prompt_hash": rec.prompt_hash.encode(), "status": rec.status.encode(),
                   "http_status": rec.http_status, "finish_reason": rec.finish_reason.encode()[:16],
                   "cached_tokens": rec.cached_tokens, "prompt_len": plen, "t_sent_s": rec.t_sent_s,
                   "t_first_token_s": rec.t_first_token_s, "t_done_s": rec.t_done_s,
                   "dtype": rec.dtype.encode()[:8], "token_offset": n_tok, "n_tokens": len(toks),
                   "prompt_offset": n_prompt}
            for name in _FIXED:
                rows[name].append(row[name])
            for name in _RAGGED:
                ragged[name].append(str(getattr(rec, name)).encode("utf-8"))
            n_tok += len(toks)
            n_prompt += len(pids)
        ds = self._handles()  # h5py group lookups cost ~0.1 ms each: look up once per writer
        ext = self._extend_fast
        for name, parts in cols.items():
            if parts:
                d = ds["tokens/" + name]
                ext(d, np.concatenate(parts).astype(d.dtype, copy=False))
        ext(ds["prompt/token_id"], np.concatenate(all_pids).astype("<i4", copy=False))
        for name, (dt, _) in _FIXED.items():
            ext(ds["requests/" + name], np.array(rows[name], dtype=dt))
        for name, datas in ragged.items():
            end = ds[f"requests/{name}_end"]
            prev = int(end[-1]) if end.shape[0] else 0
            ext(ds[f"requests/{name}_bytes"], np.frombuffer(b"".join(datas), dtype=np.uint8))
            ext(end, (prev + np.cumsum([len(d) for d in datas])).astype("<i8"))
        self.n_tokens, self.n_prompt = n_tok, n_prompt
        self.n_requests += len(items)
        if flush:
            self.flush()
        return len(items)

    def _handles(self) -> dict:
        """Every dataset of the file by path, looked up once (used by append_many)."""
        if getattr(self, "_ds_cache", None) is None:
            self._ds_cache = {f"{g}/{n}": self._f[g][n] for g in ("tokens", "requests", "prompt") for n in self._f[g]}
        return self._ds_cache

    @staticmethod
    def _extend_fast(ds: h5py.Dataset, values: np.ndarray) -> None:
        """`_extend` through h5py's low-level API: the high-level resize + slice write
        costs ~130 us a dataset in Python overhead, this ~20 us. `values` must already
        have the dataset's dtype and trailing shape."""
        m = len(values)
        if m == 0:
            return
        dsid = ds.id
        n = dsid.shape[0]
        tail = tuple(dsid.shape[1:])
        dsid.set_extent((n + m,) + tail)
        fspace = dsid.get_space()
        fspace.select_hyperslab((n,) + (0,) * len(tail), (m,) + tail)
        values = np.ascontiguousarray(values)
        dsid.write(h5py.h5s.create_simple(values.shape), fspace, values)

    def flush(self) -> None:
        # Flush the file, not the datasets: a dataset-only flush left files that
        # reopened as "likely file corruption" after SIGKILL.
        self._f.flush()

    def close(self) -> None:
        if self._f.id.valid:
            self._f.flush()
            self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- reading ----------------------------------------------------------------

def _read_ragged(group: h5py.Group, name: str, n: int) -> np.ndarray:
    end = group[f"{name}_end"][:n]
    data = group[f"{name}_bytes"][: int(end[-1]) if n else 0].tobytes()
    starts = np.concatenate([[0], end[:-1]]) if n else end
    out = np.empty(n, dtype=object)
    for i, (s, e) in enumerate(zip(starts.tolist(), end.tolist())):
        out[i] = data[s:e].decode("utf-8")
    return out


def _read_v1(f: h5py.File, path: str) -> tuple[RunMeta, RequestTable]:
    req = f["requests"]
    # In a file whose writer died, columns can differ by the rows of a request
    # that was half written; the committed rows are those present in every column.
    n = min(req[c].shape[0] for c in list(_FIXED) + [f"{r}_end" for r in _RAGGED])
    cols = {}
    for name, (dt, _) in _FIXED.items():
        a = req[name][:n]
        cols[name] = a.astype(str).astype(object) if dt.startswith("S") else a
    for name in _RAGGED:
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
        raise TraceFormatError(f"{path}: missing root attribute {missing[0]!r}; the file is not a complete "
                               f"tracekit trace (re-capture it)")
    try:
        layout = Layout(topk=int(a["topk"]), raw_logits=bool(a["raw_logits"]), vocab_size=int(a["vocab_size"]))
        meta = RunMeta(source=str(a["source"]), run=json.loads(a["run"]), layout=layout,
                       format_version=int(a["format_version"]), writer=str(a["writer"]),
                       created_utc=str(a["created_utc"]))
    except KeyError as e:
        raise TraceFormatError(f"{path}: missing root attribute {e.args[0]!r}; the file is not a complete "
                               f"tracekit trace (re-capture it)") from None
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
            f"(version {FORMAT_VERSION}); upgrade tracekit (pip install -U tracekit)")
    if version not in _READERS:
        raise SchemaVersionError(f"{path}: unknown trace format version {version} "
                                 f"(this tracekit reads {sorted(_READERS)})")
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
                raise TraceFormatError(f"{self.path}: missing dataset ({_first_line(e)}); "
                                       "the file is not a complete tracekit trace") from None
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
        get = lambda name: tok[name][s:e] if name in tok else None
        return TokenColumns(get("token_id"), get("logprob"), get("t_arrival_s"), get("topk_id"),
                            get("topk_logprob"), get("topk_logit"), get("logits") if full_logits else None)

    def prompt_ids(self, i: int) -> np.ndarray | None:
        """Prompt token ids of row i, or None when the prompt length is unknown."""
        n = int(self.requests.prompt_len[i])
        if n < 0:
            return None
        s = int(self.requests.prompt_offset[i])
        return self._f["prompt/token_id"][s:s + n]

    def column(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A whole token column (or a row range of it) as one numpy array."""
        tok = self._f["tokens"]
        if name not in tok:
            raise TraceFormatError(f"{self.path}:/tokens/{name}: column not in this trace "
                                   f"(columns: {', '.join(sorted(tok))})")
        ds = tok[name]
        n = self.n_token_rows
        rows = rows or slice(0, n)
        out = np.empty((len(range(*rows.indices(n))),) + ds.shape[1:], dtype=ds.dtype)
        if len(out):
            ds.read_direct(out, np.s_[rows])
        return out

    def columns(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {n: self.column(n) for n in names}


def copy_requests(reader: TraceReader, writer: TraceWriter, rows: Iterable[int]) -> int:
    """Copy request rows (with tokens and prompt ids) into another trace; used by --resume."""
    n = 0
    for i in rows:
        toks = reader.tokens(i, full_logits=writer.layout.vocab_size > 0)
        writer.append(reader.record(i), toks, reader.prompt_ids(i), flush=False)
        n += 1
    writer.flush()
    return n


def read_token_rows(reader: TraceReader, name: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (any order, repeats allowed) of token column `name`, as one array.

    Used by the analysis to fetch top-k rows at divergence positions only,
    instead of reading whole [N, k] columns. h5py's fancy selection wants
    sorted unique indices, so read those once and scatter back.
    """
    tok = reader._f["tokens"]
    if name not in tok:
        raise TraceFormatError(f"{reader.path}:/tokens/{name}: column not in this trace "
                               f"(columns: {', '.join(sorted(tok))})")
    ds = tok[name]
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return np.empty((0,) + ds.shape[1:], dtype=ds.dtype)
    uniq, inverse = np.unique(rows, return_inverse=True)
    if uniq[0] < 0 or uniq[-1] >= reader.n_token_rows:
        raise TraceFormatError(f"{reader.path}:/tokens/{name}: row {int(uniq[-1])} out of range "
                               f"(the trace has {reader.n_token_rows} rows)")
    # One slab read when the rows are dense enough; a point selection otherwise.
    span = int(uniq[-1] - uniq[0] + 1)
    if span <= 8 * len(uniq):
        got = ds[int(uniq[0]):int(uniq[-1]) + 1][uniq - uniq[0]]
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
