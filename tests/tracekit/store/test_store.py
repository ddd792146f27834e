"""Trace store: round trips, lazy reads, version checks, secrets, resume copies."""

import json
import math

import h5py
import numpy as np
import pytest

from tracekit.errors import SchemaVersionError, TraceFormatError
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceReader, TraceWriter, copy_requests


def _tokens(n, k=4, raw=False, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100, size=(n, k)).astype(np.int32)
    lp = -rng.random((n, k)).astype(np.float32)
    return TokenColumns(ids[:, 0], lp[:, 0], np.arange(n, dtype=np.float64), ids, lp, lp * 3 if raw else None)


def _write(path, rows, layout=None, run=None, **kw):
    layout = layout or Layout(topk=4)
    meta = RunMeta(source="http", run=run or {"model": "m"}, layout=layout)
    with TraceWriter(path, meta, **kw) as w:
        for rec, toks, prompt in rows:
            w.append(rec, toks, prompt)
    return path


def test_round_trip_every_column(tmp_path):
    rec = RequestRecord(
        key="a",
        prompt_hash=prompt_hash("hi"),
        status="ok",
        http_status=200,
        finish_reason="stop",
        cached_tokens=16,
        t_sent_s=1.0,
        t_first_token_s=1.5,
        t_done_s=2.0,
        params='{"x": 1}',
        prompt_text="hi ü",
    )
    toks = _tokens(5, raw=True)
    p = _write(tmp_path / "t.h5", [(rec, toks, [1, 2, 3])], layout=Layout(topk=4, raw_logits=True))
    with TraceReader(p) as r:
        got = r.record(0)
        assert got.key == "a" and got.cached_tokens == 16 and got.prompt_len == 3 and got.output_len == 5
        assert got.finish_reason == "stop" and got.prompt_text == "hi ü" and got.http_status == 200
        assert got.ttft_s == pytest.approx(0.5) and got.e2e_s == pytest.approx(1.0)
        t = r.tokens(0)
        for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit"):
            np.testing.assert_array_equal(getattr(t, name), getattr(toks, name))
        np.testing.assert_array_equal(r.prompt_ids(0), [1, 2, 3])


def test_unknowns_stay_unknown(tmp_path):
    """Unknown is -1 / NaN / None, never 0: cached_tokens=0 would claim 'no reuse'."""
    p = _write(tmp_path / "t.h5", [(RequestRecord(key="a", prompt_hash="h", status="error"), None, None)])
    with TraceReader(p) as r:
        rec = r.record(0)
        assert rec.cached_tokens == -1 and rec.prompt_len == -1 and rec.http_status == -1
        assert math.isnan(rec.t_sent_s) and r.prompt_ids(0) is None and rec.output_len == 0


def test_lazy_request_read_and_columns(tmp_path):
    rows = [(RequestRecord(key=f"k{i}", prompt_hash="h"), _tokens(i + 1, seed=i), [i]) for i in range(50)]
    p = _write(tmp_path / "t.h5", rows)
    with TraceReader(p) as r:
        assert len(r) == 50 and r.n_token_rows == sum(range(1, 51))
        np.testing.assert_array_equal(r.tokens(37).topk_id, rows[37][1].topk_id)
        col = r.column("logprob")
        assert col.shape == (r.n_token_rows,)
        np.testing.assert_array_equal(col[-50:], rows[49][1].logprob)
        assert r.requests.index_by_key()["k12"] == 12
        with pytest.raises(TraceFormatError, match="/tokens/logits: column not in this trace"):
            r.column("logits")


def test_narrower_topk_is_padded(tmp_path):
    p = _write(
        tmp_path / "t.h5", [(RequestRecord(key="a", prompt_hash="h"), _tokens(3, k=2), None)], layout=Layout(topk=4)
    )
    with TraceReader(p) as r:
        t = r.tokens(0)
        assert t.topk_id.shape == (3, 4) and (t.topk_id[:, 2:] == -1).all() and np.isnan(t.topk_logprob[:, 2:]).all()


def test_secrets_never_stored(tmp_path):
    p = _write(
        tmp_path / "t.h5",
        [],
        run={"model": "m", "api_key": "sk-SECRET1", "headers": {"Authorization": "Bearer sk-SECRET2"}},
    )
    assert b"SECRET" not in p.read_bytes()
    with TraceReader(p) as r:
        assert r.meta.run == {"model": "m", "headers": {}}


def test_newer_version_is_a_clear_error(tmp_path):
    p = _write(tmp_path / "t.h5", [])
    with h5py.File(p, "r+") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(SchemaVersionError, match=r"version 99 is newer than this tracekit reads \(version 1\)"):
        TraceReader(p)


def test_not_a_trace(tmp_path):
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = [1, 2]
    with pytest.raises(TraceFormatError, match="without a 'format' attribute"):
        TraceReader(plain)
    rand = tmp_path / "rand.h5"
    rand.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(TraceFormatError, match="not a readable HDF5 file"):
        TraceReader(rand)


def test_missing_attribute_is_an_error_not_a_guess(tmp_path):
    p = _write(tmp_path / "t.h5", [])
    with h5py.File(p, "r+") as f:
        del f.attrs["source"]
    with pytest.raises(TraceFormatError, match="missing root attribute 'source'"):
        TraceReader(p)


def test_copy_requests_for_resume(tmp_path):
    rows = [
        (RequestRecord(key=f"k{i}", prompt_hash="h", status="ok" if i % 2 else "error"), _tokens(2, seed=i), [i])
        for i in range(6)
    ]
    src = _write(tmp_path / "a.h5", rows)
    meta = RunMeta(source="http", run={}, layout=Layout(topk=4))
    with TraceReader(src) as r, TraceWriter(tmp_path / "b.h5", meta) as w:
        ok = [i for i in range(len(r)) if r.requests.status[i] == "ok"]
        assert copy_requests(r, w, ok) == 3
    with TraceReader(tmp_path / "b.h5") as r:
        assert list(r.requests.key) == ["k1", "k3", "k5"]
        np.testing.assert_array_equal(r.tokens(2).topk_id, rows[5][1].topk_id)


def test_no_tmp_file_left(tmp_path):
    _write(tmp_path / "t.h5", [])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.h5"]


def test_run_meta_is_json(tmp_path):
    p = _write(tmp_path / "t.h5", [], run={"model": "m", "nested": {"a": [1, 2]}})
    with h5py.File(p, "r") as f:
        assert json.loads(f.attrs["run"]) == {"model": "m", "nested": {"a": [1, 2]}}
