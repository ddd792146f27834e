"""The writer's per-trace fixed costs (issue 25) keep what they replaced exactly.

- Dataset handles are opened through the low-level API: each gets the raw-data chunk cache
  the high-level rule gave (none for plain chunks, one chunk for compressed or checksummed).
- close() asks repack_if_sparse only when the file could be sparse: the writer counts the bytes
  it appended, which are the content repack_if_sparse sums, so skipping it decides the same.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceReader, TraceWriter
from tracekit.store.writer import SPARSE_SLACK


def _items(n_req: int, n_tok: int, k: int, raw: bool = False, vocab: int = 0):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n_req):
        ids = rng.integers(0, 1000, (n_tok, k))
        lp = -rng.random((n_tok, k)).astype(np.float32)
        logits = rng.random((n_tok, vocab)).astype(np.float32) if vocab else None
        t = np.arange(n_tok, dtype=np.float64)
        toks = TokenColumns(ids[:, 0], lp[:, 0], t, ids, lp, lp if raw else None, logits)
        rec = RequestRecord(key=f"r{i}", prompt_hash=prompt_hash(f"p{i}"), prompt_len=3, params='{"x": 1}')
        out.append((rec, toks, [1, 2, i]))
    return out


def _content(path) -> int:
    with h5py.File(path, "r") as f:
        sizes = []
        f.visititems(lambda n, o: sizes.append(o.size * o.dtype.itemsize) if isinstance(o, h5py.Dataset) else None)
    return sum(sizes)


@pytest.mark.parametrize(
    "checksums,raw,vocab", [(True, False, 0), (False, False, 0), (True, True, 16), (False, False, 16)]
)
def test_handles_get_the_chunk_cache_of_the_high_level_rule(tmp_path, checksums, raw, vocab):
    meta = RunMeta(source="http", run={}, layout=Layout(topk=4, raw_logits=raw, vocab_size=vocab))
    with TraceWriter(tmp_path / "t.h5", meta, checksums=checksums) as w:
        w.append_many(_items(3, 5, 4, raw, vocab))
        handles = w._handles()
        assert len(handles) == sum(len(w._f[g]) for g in ("tokens", "requests", "prompt", "rowcheck")) >= 27
        assert {"rowcheck/topk_lp", "rowcheck/flags"} <= set(handles)  # the row checks, with the rows
        for name, ds in handles.items():
            want = int(np.prod(ds.chunks)) * ds.dtype.itemsize if ds.chunks and (ds.compression or ds.fletcher32) else 0
            assert ds.id.get_access_plist().get_chunk_cache()[1:] == (want, 1.0), name  # (slots,) bytes, w0
        filtered = [ds for ds in handles.values() if ds.id.get_access_plist().get_chunk_cache()[1] > 0]
        assert bool(filtered) == (checksums or vocab > 0)


@pytest.mark.parametrize("n_req,expected", [(2, None), (400, 400 * 40)])
def test_close_skips_the_repack_only_where_it_would_not_repack(tmp_path, monkeypatch, n_req, expected):
    """A small trace in big chunks is still repacked at close; a large one is left alone, and the
    writer's count of appended bytes is the content repack_if_sparse sums."""
    import tracekit.store.writer as W

    asked = []
    real = W.repack_if_sparse
    monkeypatch.setattr(W, "repack_if_sparse", lambda p: asked.append(real(p)) or asked[-1])
    path = tmp_path / "t.h5"
    with TraceWriter(path, RunMeta(source="http", run={}, layout=Layout(topk=20)), expected_tokens=expected) as w:
        w.append_many(_items(n_req, 40, 20))
        w.append_many(_items(1, 0, 20)[:0])
    assert w._content == _content(path)
    sparse_before = os.path.getsize(path) > 2 * w._content + SPARSE_SLACK
    assert asked == ([True] if n_req == 2 else [])
    assert not sparse_before  # after close: every trace fits its content
    with TraceReader(path) as r:
        assert len(r) == n_req and r.tokens(n_req - 1).topk_id.shape == (40, 20)
