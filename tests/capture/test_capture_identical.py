"""A capture checks each row once (issue 25) and writes the same trace as when it checked twice.

`postprocess.storable` checks every answer (`tracekit.store.check_request`) and hands the writer
the checked `Row`, which the writer appends without a second check; before, the writer checked
each row again. The same capture (a replayed vLLM, the run's clock pinned so that the times are
equal too) is run both ways: every dataset (values, dtype, shape) and every root attribute but
the creation time is equal, the run metadata but its start time, URL and prompt path too, and check_request ran once
a row instead of twice. A row the trace cannot hold is still refused with the same error, both
by the capture (an error row that says why) and by the writer given it directly.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from support.replay import ReplayServer, routes_for

import tracekit.capture.postprocess as postprocess
import tracekit.store.writer as writer_mod
from tracekit.capture.client import Clock, Outcome
from tracekit.errors import TraceFormatError
from tracekit.schema import Layout, RequestRecord, RunMeta, prompt_hash
from tracekit.store import TraceWriter, check_request

PROMPTS = [
    {"id": "a", "prompt": "x"},
    {"id": "long", "prompt": "FAULT:badfinish"},  # a finish reason the trace cannot hold
    {"id": "surrogate", "prompt": "FAULT:surrogate"},  # error text with a lone surrogate
    {"id": "b", "prompt": "y"},
    {"id": "c", "prompt": [1, 2, 3]},
]
TIMESTAMPS = {"created_utc"}  # root attributes that say when; the run's own: started_utc


def _datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        attrs = {k: v for k, v in f.attrs.items() if k not in TIMESTAMPS}
    run = json.loads(attrs.pop("run"))
    run.pop("started_utc")
    run.pop("target")  # each run's replay server listens on its own port
    run["prompts"].pop("path")  # and reads its own prompt file (the same lines: sha256 kept)
    return out, attrs, run


def _counting(monkeypatch, module) -> list:
    calls = []
    real = module.check_request

    def counted(*a, **kw):
        calls.append(a[0].key)
        return real(*a, **kw)

    monkeypatch.setattr(module, "check_request", counted)
    return calls


def _capture(capture_to, monkeypatch, name: str, old: bool):
    monkeypatch.setattr(Clock, "__call__", lambda self: 0.25)  # every time stamp equal in both runs
    if old:  # the outcome carries no checked row: the writer checks every row again
        monkeypatch.setattr(postprocess, "_with_row", lambda o, layout: Outcome(*_checked(o, layout)[:3]))
    post_calls = _counting(monkeypatch, postprocess)
    writer_calls = _counting(monkeypatch, writer_mod)
    with ReplayServer(routes_for("vllm")) as srv:
        s, out = capture_to(srv.url, PROMPTS, name=name, concurrency=1)
    monkeypatch.undo()
    return s, out, post_calls, writer_calls


def _checked(o: Outcome, layout: Layout) -> tuple:
    postprocess.check_request(o.record, o.tokens, o.prompt_ids, layout, "response")
    return o.record, o.tokens, o.prompt_ids


def test_checking_once_writes_the_same_trace(capture_to, monkeypatch):
    s_new, new, post_new, writer_new = _capture(capture_to, monkeypatch, "new.h5", old=False)
    s_old, old, post_old, writer_old = _capture(capture_to, monkeypatch, "old.h5", old=True)
    assert s_new.counts == s_old.counts == {"ok": 3, "error": 2, "cancelled": 0, "timeout": 0}

    d_new, a_new, r_new = _datasets(new)
    d_old, a_old, r_old = _datasets(old)
    assert sorted(d_new) == sorted(d_old) and len(d_new) >= 20
    for name in d_new:
        assert d_new[name].dtype == d_old[name].dtype, name
        assert d_new[name].shape == d_old[name].shape, name
        assert np.array_equal(d_new[name], d_old[name], equal_nan=d_new[name].dtype.kind == "f"), name
    assert len(d_new["tokens/token_id"]) > 0 and len(d_new["requests/status"]) == len(PROMPTS)
    assert a_new == a_old and r_new == r_old

    # The refused answers became the same error rows (the fallbacks checked in storable, both ways).
    status = dict(zip(_keys(d_new), d_new["requests/status"]))
    assert status[b"long"] == status[b"surrogate"] == b"error" and status[b"a"] == b"ok"

    # Once a row now (storable's first try, plus one per fallback of a refused answer), and the
    # writer none; before, the writer checked each stored row again.
    assert sorted(post_new) == sorted(post_old)
    assert writer_new == [] and sorted(writer_old) == sorted(p["id"] for p in PROMPTS)
    assert all(post_new.count(k) == 1 for k in ("a", "b", "c")) and post_new.count("long") >= 2


def _keys(d: dict) -> list[bytes]:
    data, ends = d["requests/key_bytes"].tobytes(), d["requests/key_end"]
    return [data[a:b] for a, b in zip(np.r_[0, ends[:-1]], ends)]


def _meta(k=4) -> RunMeta:
    return RunMeta(source="http", run={}, layout=Layout(topk=k))


def test_a_bad_row_is_refused_with_the_same_error(tmp_path):
    """The writer given the raw tuple refuses it as before; a Row checked for another layout is
    checked again against the writer's, never taken as checked."""
    bad = RequestRecord(key="bad", prompt_hash=prompt_hash("bad"), finish_reason="x" * 17)
    with pytest.raises(TraceFormatError) as direct:
        check_request(bad, None, None, Layout(topk=4), str(tmp_path / "t.h5"))
    with TraceWriter(tmp_path / "t.h5", _meta()) as w:
        with pytest.raises(TraceFormatError) as got:
            w.append_many([(bad, None, None)])
        assert str(got.value) == str(direct.value)
        assert "finish_reason 'xxxx" in str(got.value) and w.n_requests == 0

        good = RequestRecord(key="g", prompt_hash=prompt_hash("g"), prompt_len=2)
        row = check_request(good, None, [1, 2], Layout(topk=4), "response")
        assert w.append_many([row]) == 1
        with pytest.raises(TraceFormatError, match="already in this trace"):
            w.append_many([row])  # a checked row's key is still checked against the trace's

    from tracekit.schema import TokenColumns

    wide = TokenColumns(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros((1, 8)), np.zeros((1, 8)))
    row8 = check_request(RequestRecord(key="w", prompt_hash=prompt_hash("w")), wide, None, Layout(topk=8))
    with TraceWriter(tmp_path / "u.h5", _meta(4)) as w:
        with pytest.raises(TraceFormatError, match="top-k width 8 exceeds the trace's width 4"):
            w.append_many([row8])
