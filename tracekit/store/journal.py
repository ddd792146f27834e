"""The write-ahead journal that makes a killed capture recoverable.

HDF5 alone cannot promise a readable file after SIGKILL: a writer killed in
the middle of a flush can leave a metadata object that an SWMR reader retries
forever (seen here: a reader hung 12 minutes on one dataset's header). So the
writer first appends each group of requests to `<trace>.journal`, a flat file
of self-checking records, and only then writes the HDF5 file; a clean close
deletes the journal. A reader that finds a trace left "open for write" by a
writer that is no longer running rebuilds the trace from its journal
(`recovery.recover`). A torn last record (the kill landed inside it) fails its CRC and
is dropped: it was never acknowledged.

Record: b"TKJ1" · u64 payload length · u32 crc32(payload) · payload, where
payload = u32 header length · JSON header · the arrays' raw bytes, in header order.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import struct
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..schema import RequestRecord, RunMeta, TokenColumns

MAGIC = b"TKJ1"
_HEAD = struct.Struct("<4sQI")
_TOKEN_COLS = ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit", "logits")
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))  # flat scalars and strings


def journal_path(trace: str | os.PathLike) -> Path:
    return Path(os.fspath(trace) + ".journal")


def _encode(header: dict, arrays: Sequence[np.ndarray] = ()) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = dict(header, arrays=[[a.dtype.str, list(a.shape)] for a in arrays])
    h = json.dumps(header).encode()
    payload = b"".join([struct.pack("<I", len(h)), h] + [a.tobytes() for a in arrays])
    return _HEAD.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode(payload: bytes) -> tuple[dict, list[np.ndarray]]:
    (hlen,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4 : 4 + hlen])
    pos, arrays = 4 + hlen, []
    for dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        arrays.append(np.frombuffer(payload, dtype=dt, count=n // dt.itemsize, offset=pos).reshape(shape))
        pos += n
    return header, arrays


class JournalWriter:
    """Appends records; `append` returns once the bytes are in the OS (which
    survives the death of this process; an OS crash is out of scope)."""

    def __init__(self, trace: str | os.PathLike, meta: RunMeta):
        self.path = journal_path(trace)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # Held for the writer's lifetime; the kernel drops it when the process dies, even by
        # SIGKILL: a reader that can take it knows the writer is gone (a pid can be reused).
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a filesystem without locks: readers fall back to the pid
        self._write(
            _encode(
                {
                    "kind": "meta",
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "source": meta.source,
                    "run": meta.run,
                    "created_utc": meta.created_utc,
                    "layout": dataclasses.asdict(meta.layout),
                }
            )
        )

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def append(self, items: Sequence[tuple]) -> None:
        """items: (RequestRecord, TokenColumns (padded to the layout), prompt ids (int32) or None)."""
        recs, arrays = [], []
        for rec, toks, pids in items:
            recs.append(
                {
                    **{f: getattr(rec, f) for f in _RECORD_FIELDS},  # = asdict (no deep copies)
                    "_prompt": pids is not None,
                    "_cols": [c for c in _TOKEN_COLS if getattr(toks, c) is not None],
                }
            )
            arrays += [getattr(toks, c) for c in recs[-1]["_cols"]]
            arrays.append(np.asarray(pids if pids is not None else [], dtype=np.int32))
        self._write(_encode({"kind": "requests", "requests": recs}, arrays))

    def close(self, delete: bool) -> None:
        os.close(self._fd)
        if delete:
            self.path.unlink(missing_ok=True)


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos = 0
    while pos + _HEAD.size <= len(data):
        magic, n, crc = _HEAD.unpack_from(data, pos)
        payload = data[pos + _HEAD.size : pos + _HEAD.size + n]
        if magic != MAGIC or len(payload) != n or zlib.crc32(payload) != crc:
            return  # a torn tail: the kill landed inside this record
        yield payload
        pos += _HEAD.size + n


def read_journal(path: str | os.PathLike) -> tuple[dict, list[tuple]]:
    """The meta header and every complete request of a journal."""
    recs = _records(Path(path))
    head = next(recs, None)
    if head is None:
        return {}, []
    meta, _ = _decode(head)
    items = []
    for payload in recs:
        header, arrays = _decode(payload)
        it = iter(arrays)
        for r in header["requests"]:
            cols = {c: next(it) for c in r.pop("_cols")}
            pids = next(it)
            has_prompt = r.pop("_prompt")
            items.append((RequestRecord(**r), TokenColumns(**cols), pids if has_prompt else None))
    return meta, items


def writer_alive(meta: dict, path: str | os.PathLike | None = None) -> bool:
    """Is the process that wrote this journal still running? The writer holds a lock on
    its journal for its lifetime (`path`: the journal); where locks are not available,
    its pid on this host decides."""
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False  # nobody holds it: the writer is gone
        except BlockingIOError:
            return True
        except OSError:
            pass  # no locks here: ask the pid
        finally:
            os.close(fd)
    if meta.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(meta["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError):
        return False
    except PermissionError:
        return True
    return True
