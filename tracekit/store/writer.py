"""The append-only SWMR trace writer.

Crash safety: each group of requests goes first to the write-ahead journal
(`journal.py`, `<trace>.journal`), then into the HDF5 file, which is flushed.
The file is created under a temporary name, every dataset chunked and
resizable, SWMR mode switched on (live readers can follow a running capture),
and only then renamed into place. A clean close deletes the journal; a writer
killed with SIGKILL leaves the journal, from which any reader rebuilds the
trace with every request appended before the kill (`reader.open_h5`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from .. import __version__, rowcheck
from ..errors import TraceFormatError
from ..schema import FORMAT, FORMAT_VERSION, RequestRecord, RunMeta, TokenColumns
from .columns import (
    CHECKSUM,
    FIXED,
    RAGGED,
    REQ_CHUNK,
    ROWCHECK,
    TOK_CHUNK_ROWS,
    TOKEN_1D,
    TOKEN_COLUMNS,
    TOPK_CHUNK_BYTES,
)
from .journal import JournalWriter
from .rows import Row, check_request

SPARSE_SLACK = 64 << 10  # bytes of HDF5 metadata and partial chunks never worth a rewrite
ROWCHECK_ROWS = 1 << 12  # token rows whose row checks are computed and written at once


def repack_if_sparse(path: Path) -> bool:
    """Rewrite a closed trace whose chunks are mostly empty, with chunks fitted to
    its rows. Chunks are allocated whole, so two 6-token requests in 1 MiB top-k
    chunks made a 3.5 MB file; a large trace wastes at most one partial chunk a
    column and is left alone. Same datasets, dtypes, shapes and attributes: only
    the storage changes. Returns whether it rewrote the file."""
    with h5py.File(path, "r") as f:
        datasets = []
        f.visititems(lambda name, obj: datasets.append(name) if isinstance(obj, h5py.Dataset) else None)
        content = sum(f[n].size * f[n].dtype.itemsize for n in datasets)
        if os.path.getsize(path) <= 2 * content + SPARSE_SLACK:
            return False
        tmp = path.with_name(path.name + ".repack")
        with h5py.File(tmp, "w", libver="latest") as g:
            for k, v in f.attrs.items():
                g.attrs[k] = v
            for name in datasets:
                src = f[name]
                rows = max(1, min(src.chunks[0], src.shape[0]))
                g.create_dataset(
                    name,
                    data=src[()],
                    maxshape=(None,) + src.shape[1:],
                    chunks=None if 0 in src.shape[1:] else (rows,) + src.chunks[1:],  # [N, 0]: h5py picks
                    compression=src.compression,
                    compression_opts=src.compression_opts,
                    shuffle=src.shuffle,
                    fletcher32=src.fletcher32,
                )
    os.replace(tmp, path)
    return True


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _open_for_append(gid: h5py.h5g.GroupID, name: str) -> h5py.Dataset:
    """A dataset opened with a raw-data chunk cache for appending: none for plain chunks (each
    append is written straight to its place in the file), one chunk for filtered ones
    (compressed or checksummed: the chunk being filled is not read back, checked and decoded
    again at every append; HDF5 writes it whole, with its new checksum, at each flush). HDF5's default, 1 MiB per
    dataset, kept every chunk written while it fitted; an append-only writer never reads one
    back, and a capture's memory grew with its rows (~1.2 KB a request: +53 MB over 48,000
    12-token requests, the same append cost without it). Read through the low-level API: the
    high-level group lookups cost ~0.5 ms a dataset, 16 ms a trace."""
    dsid = h5py.h5d.open(gid, name.encode())
    plist = dsid.get_create_plist()
    nbytes = 0
    if plist.get_layout() == h5py.h5d.CHUNKED and plist.get_nfilters():  # compressed or checksummed
        nbytes = int(np.prod(plist.get_chunk())) * dsid.dtype.itemsize
    del dsid, plist  # the cache is set when a dataset is first opened: no other handle may be open
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(1, nbytes, 1.0)  # (slots, bytes, w0)
    return h5py.Dataset(h5py.h5d.open(gid, name.encode(), dapl=dapl))


class TraceWriter:
    """Append requests to a new trace. Use as a context manager.

    `append` writes one request (its tokens and prompt ids) and flushes the file
    unless `flush=False`; `flush()` makes everything appended so far durable.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        meta: RunMeta,
        expected_tokens: int | None = None,
        journal: bool = True,
        checksums: bool = True,
    ):
        # expected_tokens (a hint) shrinks chunks for small traces: a chunk is
        # allocated whole, so a 500-token trace should not carry 256 KiB chunks.
        self._chunk_cap = max(64, int(expected_tokens)) if expected_tokens else None
        # HDF5's Fletcher-32 filter on every dataset: a reader that meets a chunk whose bytes
        # changed fails naming the dataset, never hands out the damage (docs/format.md,
        # "Checksums"). Off only to measure its cost (bench/store_bench.py) or to write the
        # files of an older tracekit in tests.
        self._checksums = checksums
        self.path = Path(path)
        self.meta = meta
        self.layout = meta.layout
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._journal = JournalWriter(self.path, meta) if journal else None
        self._f = h5py.File(tmp, "w", libver="latest")
        self._init_layout()
        self._f.swmr_mode = True
        self._f.flush()
        os.replace(tmp, self.path)  # the final name only ever holds a valid file
        self.n_requests = 0
        self.n_tokens = 0
        self.n_prompt = 0
        self._keys: set[tuple[str, str, str]] = set()  # (key, history, dtype) of every row
        self._ragged_bytes = dict.fromkeys(RAGGED, 0)
        self._content = 0  # bytes appended to every dataset: what repack_if_sparse would sum
        self._unchecked: list[tuple] = []  # (topk_id, topk_logprob, token_id) of rows whose checks are not written yet
        self._unchecked_rows = 0

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
        ck = {"fletcher32": True} if self._checksums else {}
        if self._checksums:
            f.attrs["checksum"] = CHECKSUM
        req = f.create_group("requests")
        for name, (dt, _) in FIXED.items():
            req.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(REQ_CHUNK,), **ck)
        for name in RAGGED:
            req.create_dataset(f"{name}_bytes", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 12,), **ck)
            req.create_dataset(f"{name}_end", shape=(0,), maxshape=(None,), dtype="<i8", chunks=(REQ_CHUNK,), **ck)
        tok = f.create_group("tokens")
        for name, dt in (("token_id", "<i4"), ("logprob", "<f4"), ("t_arrival_s", "<f8")):
            tok.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(self._rows(TOK_CHUNK_ROWS),), **ck)
        k = max(m.layout.topk, 1)
        rows = self._rows(max(256, TOPK_CHUNK_BYTES // (4 * k)))
        cols = [("topk_id", "<i4"), ("topk_logprob", "<f4")] + ([("topk_logit", "<f4")] if m.layout.raw_logits else [])
        for name, dt in cols:
            tok.create_dataset(
                name,
                shape=(0, m.layout.topk),
                maxshape=(None, m.layout.topk),
                dtype=dt,
                chunks=(rows, k) if m.layout.topk else None,
                **(ck if m.layout.topk else {}),  # [N, 0]: no chunks, no data to check
            )
        if m.layout.vocab_size:
            v = m.layout.vocab_size
            tok.create_dataset(
                "logits",
                shape=(0, v),
                maxshape=(None, v),
                dtype="<f4",
                chunks=(self._rows(max(1, (1 << 18) // (4 * v))), v),
                compression="gzip",
                compression_opts=1,
                shuffle=True,
                **ck,
            )
        f.create_group("prompt").create_dataset(
            "token_id", shape=(0,), maxshape=(None,), dtype="<i4", chunks=(self._rows(TOK_CHUNK_ROWS),), **ck
        )
        if m.layout.topk:  # the row checks of every top-k row, computed as it is written (tracekit/rowcheck.py)
            f.attrs["rowcheck"] = rowcheck.LIMITS
            g = f.create_group("rowcheck")
            rows = self._rows(TOK_CHUNK_ROWS)
            for name, dt in ROWCHECK.items():
                g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(rows,), **ck)

    def _rows(self, default: int) -> int:
        return min(default, self._chunk_cap) if self._chunk_cap else default

    # -- appending --------------------------------------------------------
    def append(
        self,
        record: RequestRecord,
        tokens: TokenColumns | None = None,
        prompt_ids: Sequence[int] | np.ndarray | None = None,
        flush: bool = True,
    ) -> int:
        """Write one request row with its token rows; returns its row index."""
        self.append_many([(record, tokens, prompt_ids)], flush=flush)
        return self.n_requests - 1

    def append_many(self, items: Sequence[tuple | Row], flush: bool = True) -> int:
        """Write several requests, `(record, tokens|None, prompt_ids|None)` each, with one
        resize + write per dataset: a group commit. Appending costs ~25 dataset writes
        whatever its size, so a capture at high concurrency writes everything that
        finished while the previous write ran in one go. Returns the rows written.
        A request is committed once every column holds its rows and the file is flushed.

        Every request is checked first (`rows.check_request`): one that the reader
        could not read back exactly, or whose (key, history, dtype) the trace already
        holds, is a TraceFormatError, and nothing of the group is written. An item may
        instead be the `Row` that `check_request` returned for this trace's layout (a
        capture checks each answer before it gets here): it is taken as checked, so a
        row is checked once; its key is still checked against the trace's."""
        if not items:
            return 0
        where = str(self.path)
        rows = [self._checked(it, where) for it in items]
        seen = set()
        for r in rows:
            if r.unique in self._keys or r.unique in seen:
                key, hist, dt = r.unique
                extra = f" (history {hist!r}, dtype {dt!r})" if hist or dt else ""
                raise TraceFormatError(f"{where}: request {key!r}{extra} is already in this trace; keys are unique")
            seen.add(r.unique)
        if self._journal is not None:  # write-ahead: durable before the HDF5 write begins
            self._journal.append([(r.record, r.tokens, r.prompt_ids) for r in rows])
        self._write(rows)
        self._keys |= seen
        self.n_requests += len(rows)
        if flush:
            self.flush()
        return len(rows)

    def _checked(self, item: tuple | Row, where: str) -> Row:
        if type(item) is Row and (item.layout is self.layout or item.layout == self.layout):
            return item
        if type(item) is Row:  # checked against another layout: check it against this one
            return check_request(item.record, item.tokens, item.prompt_ids, self.layout, where)
        rec, toks, pids = item
        return check_request(rec, toks, pids, self.layout, where)

    def _write(self, rows: list[Row]) -> None:
        """One resize + write per dataset for the whole group."""
        lay = self.layout
        names = [n for n in TOKEN_COLUMNS if n in TOKEN_1D or n in ("topk_id", "topk_logprob")]
        if lay.raw_logits:
            names.append("topk_logit")
        if lay.vocab_size:
            names.append("logits")
        cols = {n: [] for n in names}
        for r in rows:
            t = r.tokens
            for n in names:
                a = getattr(t, n)
                if a is None:  # engines without raw logits get NaN rows in a raw-logit trace
                    a = np.full((len(t), lay.vocab_size if n == "logits" else lay.topk), np.nan, np.float32)
                cols[n].append(a)
        n_tok, n_prompt = self.n_tokens, self.n_prompt
        fixed = {name: [] for name in FIXED}
        for r in rows:
            r.fixed["token_offset"], r.fixed["prompt_offset"] = n_tok, n_prompt
            for name in FIXED:
                fixed[name].append(r.fixed[name])
            n_tok += len(r.tokens)
            n_prompt += 0 if r.prompt_ids is None else len(r.prompt_ids)
        ds = self._handles()  # h5py group lookups cost ~0.1 ms each: look up once per writer
        ext = self._extend
        whole = {}
        for name, parts in cols.items():
            d = ds["tokens/" + name]
            whole[name] = np.concatenate(parts).astype(d.dtype, copy=False)
            ext(d, whole[name])
        if "rowcheck/flags" in ds:
            self._unchecked.append((whole["topk_id"], whole["topk_logprob"], whole["token_id"]))
            self._unchecked_rows += len(whole["token_id"])
            if self._unchecked_rows >= ROWCHECK_ROWS:
                self._write_checks()
        pids = [r.prompt_ids for r in rows if r.prompt_ids is not None]
        if pids:
            ext(ds["prompt/token_id"], np.concatenate(pids).astype("<i4", copy=False))
        for name, (dt, _) in FIXED.items():
            ext(ds["requests/" + name], np.array(fixed[name], dtype=dt))
        for name in RAGGED:
            datas = [r.ragged[name] for r in rows]
            ends = self._ragged_bytes[name] + np.cumsum([len(d) for d in datas], dtype=np.int64)
            ext(ds[f"requests/{name}_bytes"], np.frombuffer(b"".join(datas), dtype=np.uint8))
            ext(ds[f"requests/{name}_end"], ends.astype("<i8"))
            self._ragged_bytes[name] = int(ends[-1])
        self.n_tokens, self.n_prompt = n_tok, n_prompt

    def _write_checks(self) -> None:
        """The row checks of the token rows written since the last call (tracekit/rowcheck.py), in
        one pass: computed per group commit they cost a capture ~0.4 us a token in numpy calls,
        per ROWCHECK_ROWS rows a tenth of that. Until then a live reader sees fewer checks than
        rows and computes them itself (reader.py); a killed writer's trace is rebuilt from its
        journal, checks included."""
        if not self._unchecked:
            return
        parts = list(zip(*self._unchecked))
        self._unchecked, self._unchecked_rows = [], 0
        entry, bits = rowcheck.stored(*(np.concatenate(p) for p in parts))
        ds = self._handles()
        self._extend(ds["rowcheck/topk_lp"], entry)
        self._extend(ds["rowcheck/flags"], bits)

    def _handles(self) -> dict:
        """Every dataset of the file by path, looked up once (used by append_many)."""
        if getattr(self, "_ds_cache", None) is None:
            self._ds_cache = {}
            for g in ("tokens", "requests", "prompt", "rowcheck"):
                if g not in self._f:
                    continue
                group = self._f[g]
                for n in group:
                    self._ds_cache[f"{g}/{n}"] = _open_for_append(group.id, n)
        return self._ds_cache

    def _extend(self, ds: h5py.Dataset, values: np.ndarray) -> None:
        """Append `values` along axis 0 through h5py's low-level API: the high-level resize + slice write
        costs ~130 us a dataset in Python overhead, this ~20 us. `values` must already
        have the dataset's dtype and trailing shape."""
        m = len(values)
        if m == 0:
            return
        self._content += values.nbytes
        dsid = ds.id
        n = dsid.shape[0]
        tail = tuple(dsid.shape[1:])
        dsid.set_extent((n + m,) + tail)
        fspace = dsid.get_space()
        fspace.select_hyperslab((n,) + (0,) * len(tail), (m,) + tail)
        values = np.ascontiguousarray(values)
        dsid.write(h5py.h5s.create_simple(values.shape), fspace, values)

    def set_run(self, run: dict) -> None:
        """Replace the run metadata (what a capture learns while it runs); written at close, since
        SWMR forbids changing an attribute while open. A killed writer's trace keeps the first."""
        self.meta = dataclasses.replace(self.meta, run=run)
        self._run_changed = True

    def flush(self) -> None:
        # Flush the file, not the datasets: a dataset-only flush left files that
        # reopened as "likely file corruption" after SIGKILL.
        self._f.flush()

    def close(self) -> None:
        if self._f.id.valid:
            self._write_checks()
            self._f.flush()
            self._f.close()
            if getattr(self, "_run_changed", False):  # the journal, kept until below, covers a kill here
                with h5py.File(self.path, "r+") as f:
                    f.attrs["run"] = json.dumps(self.meta.run, sort_keys=True)
            # The file is whole and closed: a kill from here on leaves a readable
            # file (and a stale journal that no reader consults).
            if os.path.getsize(self.path) > 2 * self._content + SPARSE_SLACK:  # else it cannot be sparse
                repack_if_sparse(self.path)
            if self._journal is not None:  # the file is complete: the journal has done its job
                self._journal.close(delete=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
