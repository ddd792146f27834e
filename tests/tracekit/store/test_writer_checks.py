"""The writer refuses what the reader could not read back exactly (issue 15, issue 11).

Before: a record with prompt_len=7 and no prompt ids was written, and the reader
then dropped it and every later row; finish_reason and dtype were cut to their
column widths without a word. Now each is a TraceFormatError that names the
request and the field, raised before anything of its group reaches the journal
or the file, and the writer goes on accepting good rows.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tracekit.errors import TraceFormatError
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceReader, TraceWriter, check_request


def toks(n=3, k=4, raw=False, ids=None):
    ids = np.arange(n * k, dtype=np.int64).reshape(n, k) if ids is None else ids
    lp = -np.ones((n, k), np.float32)
    return TokenColumns(ids[:, 0], lp[:, 0], np.arange(n, dtype=np.float64), ids, lp, lp if raw else None)


def rec(key="a", **kw):
    return RequestRecord(key=key, prompt_hash=prompt_hash(key), **kw)


GOOD = (rec("good"), toks(), [1, 2, 3])
LAYOUT = Layout(topk=4)


def bad_items():
    """(label, item, message fragment): each a request the trace cannot hold as given."""
    r = rec("bad")
    status = rec("bad")
    object.__setattr__(status, "status", "weird")  # past RequestRecord's own check
    return [
        ("prompt_len without ids", (rec("bad", prompt_len=7), toks(), None), "prompt_len=7 but no prompt ids"),
        ("prompt_len vs ids", (rec("bad", prompt_len=5), toks(), [1, 2, 3]), "prompt_len=5 but 3 prompt ids"),
        ("finish_reason too long", (rec("bad", finish_reason="x" * 17), None, None), "finish_reason 'xxxx"),
        ("finish_reason not ASCII", (rec("bad", finish_reason="stöp"), None, None), "not ASCII"),
        ("dtype not a dtype", (rec("bad", dtype="float32"), None, None), "dtype 'float32' is not one of"),
        ("dtype too long", (rec("bad", dtype="bf16-with-more"), None, None), "bytes; the column holds at most 8"),
        ("status", (status, None, None), "status 'weird' is not one of"),
        ("prompt_hash too long", (dataclasses.replace(r, prompt_hash="f" * 65), None, None), "at most 64"),
        ("NUL in a fixed string", (rec("bad", finish_reason="st\0p"), None, None), "no NUL"),
        ("http_status", (rec("bad", http_status=70000), None, None), "http_status=70000"),
        ("cached_tokens", (rec("bad", cached_tokens=-2), None, None), "cached_tokens=-2"),
        ("prompt_len", (rec("bad", prompt_len=1 << 31), None, None), "prompt_len=2147483648"),
        ("time", (rec("bad", t_sent_s=float("inf")), None, None), "t_sent_s=inf"),
        ("surrogate", (rec("bad", error="bad \ud800 text"), None, None), "error is not valid Unicode"),
        ("top-k too wide", (rec("bad"), toks(k=5), None), "top-k width 5 exceeds the trace's width 4"),
        ("raw logits", (rec("bad"), toks(raw=True), None), "created without raw_logits"),
        ("token id < -1", (rec("bad"), toks(ids=np.full((3, 4), -5)), None), "outside -1..2^31-1"),
        ("prompt id overflow", (rec("bad"), None, [1 << 33]), "outside"),
        ("not a record", ({"key": "x"}, None, None), "expected a RequestRecord"),
        ("duplicate key", (rec("good"), None, None), "'good' is already in this trace"),
    ]


@pytest.mark.parametrize("label,item,fragment", bad_items(), ids=[b[0] for b in bad_items()])
def test_rejected_whole_group_and_writer_goes_on(tmp_path, label, item, fragment):
    """A rejected request fails its whole group (the good request beside it is not written
    either), the error names the field, and the trace still reads back whole afterwards."""
    path = tmp_path / "t.h5"
    with TraceWriter(path, RunMeta(source="http", run={}, layout=LAYOUT)) as w:
        w.append(*GOOD)
        with pytest.raises(TraceFormatError, match="(?i)request") as e:
            w.append_many([(rec("beside"), toks(), [4]), item])
        assert fragment in str(e.value) and str(path) in str(e.value)
        w.append(rec("after"), toks(2), [5, 6])
    with TraceReader(path) as r:
        assert list(r.requests.key) == ["good", "after"]
        np.testing.assert_array_equal(r.prompt_ids(1), [5, 6])
        assert r.n_token_rows == 5


def test_column_widths_are_accepted_in_full(tmp_path):
    """The longest values that fit are stored whole, never cut."""
    path = tmp_path / "t.h5"
    meta = RunMeta(source="teacher_forced", run={}, layout=LAYOUT)
    with TraceWriter(path, meta) as w:
        w.append(rec("a", finish_reason="x" * 16, dtype="bf16", history="full"), toks(), [1])
        w.append(rec("a", finish_reason="content_filter", dtype="fp32", history="full"), toks(), [1])
        w.append(rec("a", dtype="bf16", history="decode"), None, None)
    with TraceReader(path) as r:
        assert list(r.requests.finish_reason) == ["x" * 16, "content_filter", ""]
        assert list(r.requests.dtype) == ["bf16", "fp32", "bf16"]


def test_token_ids_that_int32_would_wrap_are_refused():
    with pytest.raises(ValueError, match="do not fit int32"):
        toks(ids=np.full((3, 4), 1 << 40))
    with pytest.raises(ValueError, match="must be integers"):
        TokenColumns([1.5], [0.0], [0.0], [[1]], [[0.0]])


def test_check_request_is_public_for_captures():
    """A capture can test an engine's answer before the writer sees it."""
    row = check_request(rec("a", finish_reason="stop"), toks(), [1, 2], LAYOUT)
    assert row.fixed["prompt_len"] == 2 and row.fixed["finish_reason"] == b"stop"
    with pytest.raises(TraceFormatError, match="finish_reason"):
        check_request(rec("a", finish_reason="an_engine_specific_reason"), None, None, LAYOUT)


def test_small_traces_are_small(tmp_path):
    """Issue 11: two 6-token requests took 3.5 MB of preallocated chunks; size follows content."""
    path = tmp_path / "t.h5"
    with TraceWriter(path, RunMeta(source="http", run={}, layout=Layout(topk=20, raw_logits=True))) as w:
        for i in range(2):
            w.append(rec(f"k{i}", finish_reason="length"), toks(6, 20, raw=True), [1, 2])
    assert os.path.getsize(path) < 64 << 10
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.h5"]
    with TraceReader(path) as r:
        assert len(r) == 2 and r.n_token_rows == 12
        np.testing.assert_array_equal(r.tokens(1).topk_id, toks(6, 20).topk_id)


def test_large_traces_are_not_rewritten(tmp_path):
    """A trace whose chunks are full is left as written (a rewrite would copy it whole)."""
    path = tmp_path / "t.h5"
    n = 1 << 16
    with TraceWriter(path, RunMeta(source="http", run={}, layout=Layout(topk=4))) as w:
        w.append(rec("a"), toks(n), None)
        ino = os.stat(path).st_ino
    assert os.stat(path).st_ino == ino
    assert os.path.getsize(path) < 1.3 * n * (4 + 4 + 8 + 16 + 16)
