"""Read and check a version-1 trace: root attributes, the request table, and
every column's presence, dtype and shape, before a single row is handed out.

A closed trace must be whole: every request column has the same rows, the
token and prompt offsets tile their columns exactly, ragged strings end where
their bytes end. Anything else is damage, and a TraceFormatError that names the
file, the column and what is wrong; rows are never dropped to make a file fit.
Only a live trace (its writer still running, read through SWMR) may show a
request whose columns are half written: those trailing rows are not yet
committed and are left out until the writer's next flush.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h5py
import numpy as np

from ..errors import TraceFormatError
from ..runrecord import RunRecord
from ..schema import SOURCES, Layout, RequestTable, RunMeta
from .columns import CHECKSUM, ENUMS, FIXED, PROMPT_DTYPE, RAGGED, TOKEN_1D, TOKEN_TOPK

ATTRS = ("source", "run", "topk", "raw_logits", "vocab_size", "writer", "created_utc")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# What h5py raises on a damaged file (KeyError: "incorrect metadata checksum", OSError:
# "can't read data", ValueError/RuntimeError from broken metadata). Caught only around reads.
H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError)


def _has_checksum(dsid: h5py.h5d.DatasetID) -> bool:
    dcpl = dsid.get_create_plist()
    return any(dcpl.get_filter(i)[0] == h5py.h5z.FILTER_FLETCHER32 for i in range(dcpl.get_nfilters()))


def damage(path: str, where: str, err: BaseException, dsid: h5py.h5d.DatasetID | None = None) -> TraceFormatError:
    """One line for a read of dataset `where` that HDF5 refused. A chunk that fails its
    Fletcher-32 checksum comes back from HDF5 as "filter returned failure during read"."""
    text = first_line(err)
    checked = False
    if dsid is not None and "filter returned failure" in text:
        try:
            checked = _has_checksum(dsid)
        except H5_ERRORS:
            pass
    if checked:
        return TraceFormatError(
            f"{path}:{where}: damaged data: a chunk failed its Fletcher-32 checksum (its bytes changed after "
            "they were written); the file is corrupt (re-capture it, or restore it from a copy)"
        )
    return TraceFormatError(f"{path}:{where}: unreadable ({text}); the file is damaged (re-capture it)")


def _read_checked(dsid: h5py.h5d.DatasetID, where: str, path: str, n: int | None = None) -> np.ndarray:
    try:
        return read_all(dsid, n)
    except H5_ERRORS as e:
        raise damage(path, where, e, dsid) from None


def _bad(path: str, where: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{where}: {what}; the file is damaged or not written by tracekit (re-capture it)")


def root_attrs(f: h5py.File) -> dict:
    """Every root attribute, read once (each read is an HDF5 open + read)."""
    return {name: f.attrs[name] for name in f.attrs}


def str_attr(attrs: dict, name: str, path: str) -> str:
    v = attrs[name]
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(path, f" attribute {name!r}", "not UTF-8 text") from None
    if isinstance(v, str):
        return str(v)
    raise _bad(path, f" attribute {name!r}", f"expected a string, found {type(v).__name__}")


def int_attr(attrs: dict, name: str, path: str) -> int:
    v = attrs[name]
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    raise _bad(path, f" attribute {name!r}", f"expected an integer, found {v!r:.40}")


def read_checksum(a: dict, path: str) -> str:
    """The `checksum` attribute: CHECKSUM, or "" for a file written before checksums."""
    if "checksum" not in a:
        return ""
    v = str_attr(a, "checksum", path)
    if v != CHECKSUM:
        raise _bad(path, " attribute 'checksum'", f"{v!r:.40} is not {CHECKSUM!r}")
    return v


def read_meta(a: dict, path: str, version: int) -> RunMeta:
    missing = [n for n in ATTRS if n not in a]
    if missing:
        raise TraceFormatError(
            f"{path}: missing root attribute {missing[0]!r}; the file is not a complete tracekit trace (re-capture it)"
        )
    source = str_attr(a, "source", path)
    if source not in SOURCES:
        raise _bad(path, " attribute 'source'", f"{source!r:.40} is not one of {', '.join(SOURCES)}")
    try:
        run = json.loads(str_attr(a, "run", path))
    except json.JSONDecodeError as e:
        raise _bad(path, " attribute 'run'", f"not JSON ({e})") from None
    if not isinstance(run, dict):
        raise _bad(path, " attribute 'run'", "not a JSON object")
    RunRecord.from_json(run, f"{path}: attribute 'run'")  # validates (a bad field names itself)
    topk, raw, vocab = (int_attr(a, n, path) for n in ("topk", "raw_logits", "vocab_size"))
    if topk < 0 or vocab < 0 or raw not in (0, 1):
        raise _bad(path, " attributes", f"topk={topk}, raw_logits={raw}, vocab_size={vocab} out of range")
    return RunMeta(
        source=source,
        run=run,
        layout=Layout(topk=topk, raw_logits=bool(raw), vocab_size=vocab),
        format_version=version,
        writer=str_attr(a, "writer", path),
        created_utc=str_attr(a, "created_utc", path),
        checksum=read_checksum(a, path),
    )


def _group(f: h5py.File, name: str, path: str) -> h5py.Group:
    if name not in f:
        raise TraceFormatError(f"{path}: missing group /{name}; the file is not a complete tracekit trace")
    g = f[name]
    if not isinstance(g, h5py.Group):
        raise _bad(path, f"/{name}", "expected a group")
    return g


def dataset_id(
    group: h5py.Group, name: str, dtype: str, ndim: int, path: str, dapl=None, checksum: bool = False
) -> h5py.h5d.DatasetID:
    """The dataset `name` of `group`, checked for its dtype and rank, and with `checksum` (the
    file says it has them) for its Fletcher-32 filter. Low level: the high-level wrapper costs
    ~50 us a dataset, and a trace opens about 40."""
    try:
        dsid = h5py.h5d.open(group.id, name.encode(), dapl)
    except (KeyError, ValueError, OSError) as e:  # h5py's lookup errors: say which case it is
        where = f"{group.name.rstrip('/')}/{name}"
        if name not in group:
            raise TraceFormatError(f"{path}:{where}: missing dataset; not a complete tracekit trace") from None
        if group.get(name, getclass=True) is not h5py.Dataset:
            raise _bad(path, where, "expected a dataset") from None
        raise _bad(path, where, f"unreadable ({first_line(e)})") from None
    if dsid.rank != ndim or dsid.dtype != _DTYPES.setdefault(dtype, np.dtype(dtype)):
        where = f"{group.name.rstrip('/')}/{name}"
        raise _bad(path, where, f"expected {ndim}-D {np.dtype(dtype)}, found {dsid.rank}-D {dsid.dtype} {dsid.shape}")
    if checksum and not (ndim == 2 and dsid.shape[1] == 0) and not _has_checksum(dsid):  # [N, 0]: no data
        where = f"{group.name.rstrip('/')}/{name}"
        raise _bad(path, where, "no Fletcher-32 checksum filter, which the file's 'checksum' attribute promises")
    return dsid


_DTYPES: dict[str, np.dtype] = {}


def read_all(dsid: h5py.h5d.DatasetID, n: int | None = None) -> np.ndarray:
    """Rows [0, n) of a dataset (all by default), through h5py's low-level read."""
    shape = dsid.shape
    n = shape[0] if n is None else n
    out = np.empty((n,) + shape[1:], dtype=dsid.dtype)
    if n == shape[0]:
        if out.size:
            dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out
    if out.size:
        fspace = dsid.get_space()
        fspace.select_hyperslab((0,) * len(shape), out.shape)
        dsid.read(h5py.h5s.create_simple(out.shape), fspace, out)
    return out


def _check_ends(end: np.ndarray, n_bytes: int, where: str, path: str, live: bool) -> None:
    if len(end) and (end[0] < 0 or (np.diff(end) < 0).any()):
        raise _bad(path, where, "end offsets are not non-decreasing from 0")
    last = int(end[-1]) if len(end) else 0
    if last > n_bytes or (last != n_bytes and not live):
        raise _bad(path, where, f"end offsets reach byte {last}, the column holds {n_bytes}")


def _ragged(req: h5py.Group, name: str, end: np.ndarray, path: str, live: bool, ck: bool) -> np.ndarray:
    n = len(end)
    nb = dataset_id(req, f"{name}_bytes", "u1", 1, path, checksum=ck)
    _check_ends(end, nb.shape[0], f"/requests/{name}_end", path, live)
    data = _read_checked(nb, f"/requests/{name}_bytes", path, int(end[-1]) if n else 0).tobytes()
    starts = [0] + end[:-1].tolist()
    out = np.empty(n, dtype=object)
    try:
        text = data.decode("utf-8")
        if not text:  # most ragged columns (error, history, prompt_text) are empty in most traces
            out[:] = ""
        elif len(text) == len(data):  # ASCII: byte offsets are character offsets, slice the str
            out[:] = [text[s:e] for s, e in zip(starts, end.tolist())]
        else:
            out[:] = [data[s:e].decode("utf-8") for s, e in zip(starts, end.tolist())]
    except UnicodeDecodeError as e:
        raise _bad(path, f"/requests/{name}_bytes", f"not UTF-8 ({e.reason} at byte {e.start})") from None
    return out


def _columns(req: h5py.Group, path: str, live: bool, ck: bool) -> tuple[int, dict]:
    """Every fixed column and every ragged column's end offsets, cut to the rows all of them hold."""
    want = [(name, dt) for name, (dt, _) in FIXED.items()] + [(f"{r}_end", "<i8") for r in RAGGED]
    raw = {
        name: _read_checked(dataset_id(req, name, dt, 1, path, checksum=ck), f"/requests/{name}", path)
        for name, dt in want
    }
    lens = {name: len(a) for name, a in raw.items()}
    n = min(lens.values())
    if not live and max(lens.values()) != n:
        a, b = min(lens, key=lens.get), max(lens, key=lens.get)
        raise _bad(path, "/requests", f"columns disagree: {a} has {lens[a]} rows, {b} has {lens[b]}")
    cols = {}
    for name, a in raw.items():
        a = a[:n]
        if a.dtype.kind == "S":  # decode each distinct value once (status, finish reasons: a handful)
            try:
                uniq, inverse = np.unique(a, return_inverse=True)
                a = np.array([x.decode("ascii") for x in uniq.tolist()], dtype=object)[inverse]
            except UnicodeDecodeError:
                raise _bad(path, f"/requests/{name}", "not ASCII text") from None
        cols[name] = a
    return n, cols


def _check_rows(cols: dict, path: str) -> None:
    for name, allowed in ENUMS.items():
        bad = set(cols[name]) - set(allowed)
        if bad:
            i = int(np.argmax(np.isin(cols[name], list(bad))))
            raise _bad(path, f"/requests/{name}", f"row {i} holds {cols[name][i]!r:.40}, not one of {allowed}")
    for name, lo in (("n_tokens", 0), ("prompt_len", -1), ("cached_tokens", -1), ("http_status", -1)):
        if len(cols[name]) and cols[name].min() < lo:
            i = int(np.argmin(cols[name]))
            raise _bad(path, f"/requests/{name}", f"row {i} holds {int(cols[name][i])} (< {lo})")
    empty = cols["key"] == ""
    if empty.any():
        raise _bad(path, "/requests/key", f"row {int(np.argmax(empty))} has an empty key")


def _check_offsets(cols: dict, name: str, lengths: np.ndarray, rows: int, what: str, column: str, path: str) -> None:
    """Offsets must tile their column: row i starts where row i-1 ends, the last ends at its end."""
    expect = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) if len(lengths) else lengths
    off = cols[name]
    if not np.array_equal(off, expect):
        i = int(np.argmax(off != expect))
        raise _bad(path, f"/requests/{name}", f"row {i} starts at {int(off[i])}, expected {int(expect[i])}")
    total = int(lengths.sum(dtype=np.int64))
    if total != rows:
        raise _bad(path, f"/requests/{what}", f"the rows add up to {total}, {column} holds {rows}")


def _live_prefix(cols: dict, tok_rows: int, prompt_rows: int) -> int:
    """Rows of a live trace whose tokens and prompt ids are already written."""
    ends = cols["token_offset"] + cols["n_tokens"]
    p_ends = cols["prompt_offset"] + np.maximum(cols["prompt_len"], 0)
    good = (ends <= tok_rows) & (p_ends <= prompt_rows)
    return int(np.argmin(good)) if not good.all() else len(good)


def token_datasets(
    f: h5py.File, layout: Layout, path: str, logits_dapl=None, checksum: bool = False
) -> dict[str, h5py.Dataset]:
    """The token columns this layout promises, checked for dtype and width; no other may exist."""
    tok = _group(f, "tokens", path)
    want = dict(TOKEN_1D) | {k: v for k, v in TOKEN_TOPK.items() if k != "topk_logit" or layout.raw_logits}
    out = {
        n: h5py.Dataset(dataset_id(tok, n, dt, 1 if n in TOKEN_1D else 2, path, checksum=checksum))
        for n, dt in want.items()
    }
    if layout.vocab_size:
        out["logits"] = h5py.Dataset(dataset_id(tok, "logits", "<f4", 2, path, logits_dapl, checksum))
    for name in tok:
        if name not in out:
            raise _bad(path, f"/tokens/{name}", "a column the root attributes do not announce (topk_logit/logits)")
    for name, ds in out.items():
        width = layout.vocab_size if name == "logits" else layout.topk
        if ds.ndim == 2 and ds.shape[1] != width:
            raise _bad(path, f"/tokens/{name}", f"width {ds.shape[1]}, the root attributes say {width}")
    return out


@dataclass(frozen=True)
class Opened:
    """What a version's reader hands TraceReader: checked metadata, handles, the table."""

    meta: RunMeta
    tokens: dict  # column name -> h5py.Dataset
    prompt: h5py.Dataset  # /prompt/token_id
    table: RequestTable


def read_v1(f: h5py.File, attrs: dict, path: str, live: bool) -> Opened:
    """Root attributes, token column handles and the request table of a v1 file, all checked."""
    meta = read_meta(attrs, path, 1)
    ck = bool(meta.checksum)
    tokens = token_datasets(f, meta.layout, path, _logits_access(), ck)
    prompt = h5py.Dataset(dataset_id(_group(f, "prompt", path), "token_id", PROMPT_DTYPE, 1, path, checksum=ck))
    return Opened(meta, tokens, prompt, _table(f, path, tokens, prompt.shape[0], live, ck))


def _logits_access() -> h5py.h5p.PropDAID:
    """The compressed [N, V] logits keep a chunk cache (a request's rows decompress a chunk
    once); the file itself is opened without one, so whole-column reads go straight to
    the caller's array (measured: 2x faster for 1 MiB chunks)."""
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(521, 16 << 20, 0.75)
    return dapl


def _table(f: h5py.File, path: str, tokens: dict, prompt_rows: int, live: bool, ck: bool) -> RequestTable:
    """The request table, checked against its token and prompt columns."""
    req = _group(f, "requests", path)
    n, cols = _columns(req, path, live, ck)
    tok_rows = {name: ds.shape[0] for name, ds in tokens.items()}
    if live:
        n = _live_prefix(cols, min(tok_rows.values()), prompt_rows)
        cols = {k: v[:n] for k, v in cols.items()}
    for name in RAGGED:
        cols[name] = _ragged(req, name, cols.pop(f"{name}_end"), path, live, ck)
    _check_rows(cols, path)
    if not live:
        rows = tok_rows["token_id"]
        _check_offsets(cols, "token_offset", cols["n_tokens"], rows, "n_tokens", "/tokens/token_id", path)
        for name, m in tok_rows.items():
            if m != rows:
                raise _bad(path, f"/tokens/{name}", f"{m} rows, /tokens/token_id has {rows}")
        lens = np.maximum(cols["prompt_len"], 0)
        _check_offsets(cols, "prompt_offset", lens, prompt_rows, "prompt_len", "/prompt/token_id", path)
    return RequestTable(**cols)
