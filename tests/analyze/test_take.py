"""The alignment's run-wise takes (align.take, Alignment.per_row) equal the fancy takes they
replace, and a diff of traces with every class planted is the same through either path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tracekit.analyze import align as align_mod
from tracekit.analyze import diff
from tracekit.analyze.align import segments, take

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import diff_bench  # noqa: E402


@pytest.mark.parametrize("order", ["same", "shuffled", "gaps"])
def test_take_equals_fancy_take(order):
    rng = np.random.default_rng(3)
    n_req = 400
    lens = rng.integers(0, 900, n_req)
    off = np.cumsum(lens) - lens
    length = lens.copy()
    if order == "shuffled":  # B's requests in another order: short runs, the fancy take
        perm = rng.permutation(n_req)
        off, length = off[perm], length[perm]
    if order == "gaps":  # incomparable pairs (length 0) and shorter compared lengths: a few runs
        length[rng.choice(n_req, 20, replace=False)] = 0
        length = np.minimum(length, lens)
    seg, pos, _ = segments(length)
    idx = off[seg] + pos
    for x in (rng.normal(size=int(lens.sum())).astype(np.float32), rng.integers(0, 9, int(lens.sum())) > 4):
        got = take(x, idx, off, length)
        assert got.dtype == x.dtype and np.array_equal(got, x[idx])
    per = rng.integers(0, 100, n_req)
    assert np.array_equal(np.repeat(per, length), per[seg])


def test_take_out_of_range_raises_like_the_take():
    off, length = np.array([0, 5]), np.array([5, 5])
    seg, pos, _ = segments(length)
    with pytest.raises(IndexError):
        take(np.zeros(8), off[seg] + pos, off, length)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    rng = np.random.default_rng(1)
    cols, lens, cls = diff_bench.synth(20_000)
    b, cached_a, cached_b, status_b = diff_bench.plant(cols, lens, cls, rng)
    pa, pb = str(d / "a.h5"), str(d / "b.h5")
    diff_bench.write(pa, cols, lens, cached_a, np.full(len(lens), "ok", dtype=object))
    diff_bench.write(pb, b, lens, cached_b, status_b)
    return pa, pb, {c: int(np.sum(cls == c)) for c in ["identical", *diff_bench.PLANT]}


def _same(r1, r2, dtypes: bool = True):
    assert r1.columns.keys() == r2.columns.keys() and r1.notes == r2.notes
    for k, v in r1.columns.items():
        w = r2.columns[k]
        assert v.shape == w.shape and (v.dtype == w.dtype or not dtypes), k
        if v.dtype == object:
            assert v.tolist() == w.tolist(), k
        else:
            assert np.array_equal(v, w, equal_nan=v.dtype.kind == "f"), k


def test_planted_classes_the_same_by_runs_and_by_fancy_takes(planted, monkeypatch):
    pa, pb, want = planted
    fast = diff(pa, pb)
    assert {c: fast.counts()[c] for c in want} == want  # every class planted, found
    monkeypatch.setattr(align_mod, "RUN_ROWS", 10**12)  # every take a fancy take
    _same(fast, diff(pa, pb))
    streamed = diff(pa, pb, stream_positions=3000)  # windows of the traces: the same numbers again
    _same(fast, streamed, dtypes=False)  # (a chunk's integer columns may come back int64)
