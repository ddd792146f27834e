"""analyze/rowscan.py: the blocked, transposed scan of every top-k row gives exactly the row-wise
answers (order, sign, mass, the chosen token's entry), across block edges, with NaN padding,
+inf, unknown ids and masses at the limit; on a real trace written by TraceWriter."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tracekit import rowcheck
from tracekit.analyze import rowscan
from tracekit.rowcheck import POSITIVE_LIMIT, SUM_LIMIT
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceReader, TraceWriter


def _rows(n: int, K: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lps = -np.sort(rng.uniform(0.05, 9.0, (n, K)), axis=1).astype(np.float32)
    ids = (np.arange(n * K).reshape(n, K) * 7 % 4001).astype(np.int32)
    tok = ids[:, 0].copy()
    tok[::5] = ids[::5, 3]  # the chosen token listed elsewhere in some rows
    tok[::11] = 99999  # and absent from others
    chosen = lps[:, 0].copy()
    # the misreports, one kind per row
    lps[1, 2], lps[1, 3] = -0.5, -0.2  # out of order
    lps[2, K - 2 :] = np.nan  # NaN padding at the end: sorted
    lps[3, 2] = np.nan  # a value after a NaN gap: out of order
    lps[4, 1] = 0.01  # above 0
    chosen[5] = 0.002  # the chosen logprob above 0
    lps[6, 3] = np.inf
    lps[7] = np.log(np.float32(SUM_LIMIT) / K) + np.float32(1e-6)  # mass just above the limit
    lps[8] = np.log(np.float32(SUM_LIMIT) / K) - np.float32(1e-4)  # just below
    lps[9, 1] = lps[9, 0] + np.float32(0.0009)  # rounding-size disorder: sorted
    lps[10, :] = -np.inf
    return ids, lps, tok, chosen


def _rowwise(ids, lps, tok, chosen):
    """The plain row-wise formulas (what reported.py computed before the scan)."""
    with np.errstate(invalid="ignore", over="ignore"):
        disorder = (lps[:, 1:] > lps[:, :-1] + np.float32(rowscan.ORDER_TOL)).any(1)
        nan = np.isnan(lps)
        disorder |= (nan[:, :-1] & ~nan[:, 1:]).any(1)
        positive = (chosen > POSITIVE_LIMIT) | (lps > POSITIVE_LIMIT).any(1)
        mass = np.exp(lps).sum(1, where=~nan, dtype=np.float64)
    hit = ids == tok[:, None]
    entry = np.where(hit.any(1), lps[np.arange(len(ids)), hit.argmax(1)], np.nan)
    return disorder, positive, mass > SUM_LIMIT, entry


def _trace(path, ids, lps, tok, chosen, lens):
    meta = RunMeta(source="http", run={"dtype": "bf16"}, layout=Layout(topk=ids.shape[1], raw_logits=False))
    with TraceWriter(path, meta) as w:
        s = 0
        for i, n in enumerate(lens):
            e = s + n
            tc = TokenColumns(tok[s:e], chosen[s:e], np.zeros(n), ids[s:e], lps[s:e])
            w.append(
                RequestRecord(key=f"r{i}", prompt_hash="p", finish_reason="length"), tc, np.arange(4, dtype=np.int32)
            )
            s = e


def _strip(path):
    """The trace as a writer without stored row checks left it (an older tracekit's)."""
    with h5py.File(path, "r+") as f:
        del f["rowcheck"]
        del f.attrs["rowcheck"]


@pytest.mark.parametrize("stored", [True, False])  # the writer's checks, or computed by the scan
@pytest.mark.parametrize("K", [5, 6, 20])  # rows read as 1-, 2- and 4-byte ints
@pytest.mark.parametrize("block_rows", [3, 7, 64, 10_000])
def test_scan_equals_the_rowwise_checks(tmp_path, monkeypatch, block_rows, K, stored):
    ids, lps, tok, chosen = _rows(157, K)
    monkeypatch.setattr(rowscan, "BLOCK_BYTES", block_rows * 4 * K)
    monkeypatch.setattr(rowcheck, "CACHE_BYTES", max(1, block_rows // 2) * 4 * K)
    _trace(tmp_path / "t.h5", ids, lps, tok, chosen, [50, 60, 47])
    if not stored:
        _strip(tmp_path / "t.h5")
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.has_column("rowcheck/flags") is stored
        got = rowscan.scan(r, r.column("token_id"), r.column("logprob"))
    disorder, positive, heavy, entry = _rowwise(ids, lps, tok, chosen)
    assert np.flatnonzero(got.disorder).tolist() == np.flatnonzero(disorder).tolist()
    assert np.flatnonzero(got.disorder)[:2].tolist() == [1, 3]  # not 2 (NaN padding) nor 9 (rounding)
    assert np.flatnonzero(got.positive).tolist() == np.flatnonzero(positive).tolist() == [4, 5, 6]
    assert np.flatnonzero(got.heavy).tolist() == np.flatnonzero(heavy).tolist()
    assert got.heavy[6] and got.heavy[7] and not got.heavy[8]
    np.testing.assert_array_equal(got.topk_lp, entry.astype(np.float32))
    assert np.isnan(got.topk_lp[::11]).all() and got.topk_lp[5] == lps[5, 3]


def test_no_topk_no_scan(tmp_path):
    meta = RunMeta(source="http", run={"dtype": "bf16"}, layout=Layout(topk=0, raw_logits=False))
    with TraceWriter(tmp_path / "t.h5", meta) as w:
        tc = TokenColumns(
            np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32), np.zeros(2),
            np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32),
        )  # fmt: skip
        w.append(RequestRecord(key="r0", prompt_hash="p", finish_reason="length"), tc, np.arange(4, dtype=np.int32))
    with TraceReader(tmp_path / "t.h5") as r:
        assert rowscan.scan(r, r.column("token_id"), r.column("logprob")) is None


@pytest.mark.parametrize("stored", [True, False])
@pytest.mark.parametrize("block_rows", [3, 64, 10_000])
def test_kept_rows_are_the_files_rows(tmp_path, monkeypatch, block_rows, stored):
    """The rows the diff keeps during the pass (the first differences) are exactly what a read of
    those rows returns, across block edges; a row that was not kept is never made up (None: the
    caller reads the file)."""
    from tracekit.store import read_token_rows

    ids, lps, tok, chosen = _rows(157, 20)
    monkeypatch.setattr(rowscan, "BLOCK_BYTES", block_rows * 4 * 20)
    _trace(tmp_path / "t.h5", ids, lps, tok, chosen, [50, 60, 47])
    if not stored:
        _strip(tmp_path / "t.h5")
    keep = np.array([156, 0, 2, 63, 64, 2, 99])  # unsorted, repeated, at both ends and a block edge
    with TraceReader(tmp_path / "t.h5") as r:
        got = rowscan.scan(r, r.column("token_id"), r.column("logprob"), keep=keep)
        assert got.kept.tolist() == [0, 2, 63, 64, 99, 156]
        want = np.array([99, 2, 156, 2])
        kept_ids, kept_lps = got.rows(want)
        np.testing.assert_array_equal(kept_ids, read_token_rows(r, "topk_id", want))
        np.testing.assert_array_equal(kept_lps, read_token_rows(r, "topk_logprob", want))
        assert kept_ids.dtype == np.int32 and kept_lps.dtype == np.float32
        assert got.rows(np.array([2, 3])) is None and got.rows(np.array([157])) is None
        assert rowscan.scan(r, r.column("token_id"), r.column("logprob")).rows(np.array([0])) is None
