"""The row checks the writer stores (/rowcheck, tracekit/rowcheck.py): a diff that reads them gives
exactly the verdicts of a diff that computes them from the top-k columns (every red-team case of
the top-k rows family, whose bugs are the row checks' findings), other limits or an older trace
mean the checks are computed afresh, and a damaged store is a one-line error."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from support.redteam_builders import build
from test_redteam_rows import CASES

from tracekit import rowcheck
from tracekit.analyze import diff
from tracekit.errors import TraceFormatError
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceReader, TraceWriter


def _strip(path):
    with h5py.File(path, "r+") as f:
        del f["rowcheck"]
        del f.attrs["rowcheck"]


def _verdicts(r) -> list[str]:
    return [repr(p) for p in r.pairs]  # every field of every pair (repr: NaN equals NaN)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stored_checks_give_the_computed_verdicts(tmp_path, name):
    c = CASES[name]
    (tmp_path / "s").mkdir()
    (tmp_path / "c").mkdir()
    a, b = build(tmp_path / "s", c)
    stored = diff(a, b, **c.diff_kw)
    a2, b2 = build(tmp_path / "c", c)
    for p in (a2, b2):
        _strip(p)
        with TraceReader(p) as r:
            assert not r.has_column("rowcheck/flags")
    computed = diff(a2, b2, **c.diff_kw)
    with TraceReader(a) as r:
        assert r.has_column("rowcheck/flags") and r.has_column("rowcheck/topk_lp")
    assert _verdicts(stored) == _verdicts(computed)
    assert stored.counts() == computed.counts()


def _write(path, n_req=3, n=40, k=8, seed=0):
    rng = np.random.default_rng(seed)
    meta = RunMeta(source="http", run={"dtype": "bf16"}, layout=Layout(topk=k, raw_logits=False))
    lps = -np.sort(rng.uniform(2.5, 9.0, (n_req * n, k)), axis=1).astype(np.float32)
    ids = rng.integers(0, 5000, (n_req * n, k)).astype(np.int32)
    lps[5, 2], lps[5, 3] = -9.5, -9.2  # out of order
    lps[50, 0] = 0.5  # a probability above 1 (still in order)
    lps[90] = np.log(np.float32(1.2) / k)  # a row summing to 1.2
    tok = ids[:, 0].copy()
    tok[::7] = ids[::7, 2]
    with TraceWriter(path, meta) as w:
        items = []
        for i in range(n_req):
            s, e = i * n, (i + 1) * n
            tc = TokenColumns(tok[s:e], lps[s:e, 0].copy(), np.zeros(n), ids[s:e], lps[s:e])
            items.append((RequestRecord(key=f"r{i}", prompt_hash="p", finish_reason="length"), tc, None))
        w.append_many(items[:1])
        w.append_many(items[1:])  # two group commits
    return ids, lps, tok


def test_stored_columns_are_the_row_checks(tmp_path):
    ids, lps, tok = _write(tmp_path / "t.h5")
    with TraceReader(tmp_path / "t.h5") as r:
        bits = r.column("rowcheck/flags")
        entry = r.column("rowcheck/topk_lp")
    want_entry, want_bits = rowcheck.stored(ids, lps, tok)
    np.testing.assert_array_equal(bits, want_bits)
    np.testing.assert_array_equal(entry, want_entry)
    assert np.flatnonzero(bits & rowcheck.DISORDER).tolist() == [5]
    assert np.flatnonzero(bits & rowcheck.POSITIVE).tolist() == [50]
    assert np.flatnonzero(bits & rowcheck.HEAVY).tolist() == [50, 90]  # e^0.5 alone is above 1.01
    assert entry[7] == lps[7, 2] and entry[1] == lps[1, 0]
    assert np.flatnonzero(rowcheck.unpack(bits, np.where(np.arange(120) == 3, 0.01, -1.0))[1]).tolist() == [3, 50]


def test_other_limits_are_computed_afresh(tmp_path):
    _write(tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        f.attrs["rowcheck"] = rowcheck.LIMITS.replace('"sum_limit": 1.01', '"sum_limit": 2.0')
    with TraceReader(tmp_path / "t.h5") as r:
        assert not r.has_column("rowcheck/flags")
        assert r.column("topk_id").shape == (120, 8)  # the trace itself reads as before


def test_a_short_store_is_a_one_line_error(tmp_path):
    _write(tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        f["rowcheck/flags"].resize((100,))
    with pytest.raises(TraceFormatError) as e:
        TraceReader(tmp_path / "t.h5")
    msg = str(e.value)
    assert "/rowcheck/flags: 100 rows for 120 token rows" in msg and "re-capture" in msg and "\n" not in msg


def test_verify_reads_the_stored_checks(tmp_path):
    _write(tmp_path / "t.h5")
    with TraceReader(tmp_path / "t.h5") as r:
        total = r.verify()
    _strip(tmp_path / "t.h5")
    with TraceReader(tmp_path / "t.h5") as r:
        assert total - r.verify() == 120 * 5  # float32 entry + one byte of flags a row


def test_checks_are_written_in_batches_and_at_close(tmp_path, monkeypatch):
    """The writer stores the checks every ROWCHECK_ROWS rows and the rest at close; a live reader in
    between sees them lag the rows and computes them itself, a closed trace has every row's."""
    import tracekit.store.writer as W

    monkeypatch.setattr(W, "ROWCHECK_ROWS", 50)
    rng = np.random.default_rng(3)
    k, n = 4, 40
    meta = RunMeta(source="http", run={"dtype": "bf16"}, layout=Layout(topk=k, raw_logits=False))
    lps = -np.sort(rng.uniform(2.5, 9.0, (3 * n, k)), axis=1).astype(np.float32)
    ids = rng.integers(0, 500, (3 * n, k)).astype(np.int32)
    lps[100, 3] = -1.0  # out of order, in the rows written at close
    path = tmp_path / "t.h5"
    with TraceWriter(path, meta) as w:
        for i in range(3):
            s, e = i * n, (i + 1) * n
            tc = TokenColumns(ids[s:e, 0].copy(), lps[s:e, 0].copy(), np.zeros(n), ids[s:e], lps[s:e])
            w.append_many([(RequestRecord(key=f"r{i}", prompt_hash="p", finish_reason="length"), tc, None)])
            with h5py.File(path, "r", swmr=True) as f:
                assert f["rowcheck/flags"].shape == ((0,), (80,), (80,))[i]
            with TraceReader(path) as r:
                # lagging (after the first and the third group): a diff computes them
                assert r.live and r.has_column("rowcheck/flags") is (i == 1)
                assert r.column("topk_logprob").shape == ((i + 1) * n, k)
    with TraceReader(path) as r:
        bits = r.column("rowcheck/flags")
    assert len(bits) == 120 and np.flatnonzero(bits).tolist() == [100]
