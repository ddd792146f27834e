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

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from .. import __version__
from ..schema import FORMAT, FORMAT_VERSION, RequestRecord, RunMeta, TokenColumns
from .columns import FIXED, RAGGED, REQ_CHUNK, TOK_CHUNK_ROWS, TOPK_CHUNK_BYTES
from .journal import JournalWriter


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class TraceWriter:
    """Append requests to a new trace. Use as a context manager.

    `append` writes one request (its tokens and prompt ids) and flushes the file
    unless `flush=False`; `flush()` makes everything appended so far durable.
    """

    def __init__(
        self, path: str | os.PathLike, meta: RunMeta, expected_tokens: int | None = None, journal: bool = True
    ):
        # expected_tokens (a hint) shrinks chunks for small traces: a chunk is
        # allocated whole, so a 500-token trace should not carry 256 KiB chunks.
        self._chunk_cap = max(64, int(expected_tokens)) if expected_tokens else None
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
        for name, (dt, _) in FIXED.items():
            req.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(REQ_CHUNK,))
        for name in RAGGED:
            req.create_dataset(f"{name}_bytes", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 12,))
            req.create_dataset(f"{name}_end", shape=(0,), maxshape=(None,), dtype="<i8", chunks=(REQ_CHUNK,))
        tok = f.create_group("tokens")
        for name, dt in (("token_id", "<i4"), ("logprob", "<f4"), ("t_arrival_s", "<f8")):
            tok.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(self._rows(TOK_CHUNK_ROWS),))
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
            )
        f.create_group("prompt").create_dataset(
            "token_id", shape=(0,), maxshape=(None,), dtype="<i4", chunks=(self._rows(TOK_CHUNK_ROWS),)
        )

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

    def append_many(self, items: Sequence[tuple], flush: bool = True) -> int:
        """Write several requests, `(record, tokens|None, prompt_ids|None)` each, with one
        resize + write per dataset: a group commit. Appending costs ~25 dataset writes
        whatever its size, so a capture at high concurrency writes everything that
        finished while the previous write ran in one go. Returns the rows written.
        A request is committed once every column holds its rows and the file is flushed."""
        lay = self.layout
        if not items:
            return 0
        empty = TokenColumns.empty(lay.topk, lay.raw_logits, lay.vocab_size)
        cols = {
            n: [] for n in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit", "logits")
        }
        rows = {name: [] for name in FIXED}
        ragged = {name: [] for name in RAGGED}
        all_pids, journal_items = [], []
        n_tok, n_prompt = self.n_tokens, self.n_prompt
        for rec, toks, prompt_ids in items:
            toks = (toks if toks is not None else empty).padded_to(lay.topk)
            for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob"):
                cols[name].append(getattr(toks, name))
            if lay.raw_logits:  # engines without raw logits get NaN rows in a raw-logit trace
                cols["topk_logit"].append(
                    toks.topk_logit if toks.topk_logit is not None else np.full(toks.topk_id.shape, np.nan, np.float32)
                )
            if lay.vocab_size:
                if len(toks) and (toks.logits is None or toks.logits.shape[1] != lay.vocab_size):
                    raise ValueError(
                        f"{self.path}: this trace stores full logits of width {lay.vocab_size}; "
                        f"got {None if toks.logits is None else toks.logits.shape}"
                    )
                cols["logits"].append(toks.logits if len(toks) else np.zeros((0, lay.vocab_size), np.float32))
            pids = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int32)
            all_pids.append(pids)
            journal_items.append((rec, toks, pids if prompt_ids is not None else None))
            plen = rec.prompt_len if rec.prompt_len >= 0 else (len(pids) if prompt_ids is not None else -1)
            row = {
                "prompt_hash": rec.prompt_hash.encode(),
                "status": rec.status.encode(),
                "http_status": rec.http_status,
                "finish_reason": rec.finish_reason.encode()[:16],
                "cached_tokens": rec.cached_tokens,
                "prompt_len": plen,
                "t_sent_s": rec.t_sent_s,
                "t_first_token_s": rec.t_first_token_s,
                "t_done_s": rec.t_done_s,
                "dtype": rec.dtype.encode()[:8],
                "token_offset": n_tok,
                "n_tokens": len(toks),
                "prompt_offset": n_prompt,
            }
            for name in FIXED:
                rows[name].append(row[name])
            for name in RAGGED:
                ragged[name].append(str(getattr(rec, name)).encode("utf-8"))
            n_tok += len(toks)
            n_prompt += len(pids)
        if self._journal is not None:  # write-ahead: durable before the HDF5 write begins
            self._journal.append(journal_items)
        ds = self._handles()  # h5py group lookups cost ~0.1 ms each: look up once per writer
        ext = self._extend
        for name, parts in cols.items():
            if parts:
                d = ds["tokens/" + name]
                ext(d, np.concatenate(parts).astype(d.dtype, copy=False))
        ext(ds["prompt/token_id"], np.concatenate(all_pids).astype("<i4", copy=False))
        for name, (dt, _) in FIXED.items():
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
    def _extend(ds: h5py.Dataset, values: np.ndarray) -> None:
        """Append `values` along axis 0 through h5py's low-level API: the high-level resize + slice write
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
            if self._journal is not None:  # the file is complete: the journal has done its job
                self._journal.close(delete=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
