"""analyze/stream.py + window.py: a diff judged a chunk of pairs at a time is the whole diff,
column for column and note for note, whatever the chunk size: on the committed demo runs with
a calibration (the run-level flip test reduced over the chunks), and on traces built to break
the chunking (B in another order, keys on one side only, a key answered twice, a failed
request, requests of every length, chunks smaller than one request)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tracekit.analyze import diff, stream
from tracekit.analyze.calibrate import measure
from tracekit.analyze.window import Window, runs
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceReader, TraceWriter

DEMO = Path(__file__).resolve().parents[2] / "traces" / "demo"


def _demo(prompts: str, c: int) -> tuple[str, str]:
    g = DEMO / "groups" / f"ref.bf16.cache-on.{prompts}.out32" / "serial.h5"
    return str(g), str(DEMO / "cells" / f"ref.bf16.cache-on.{prompts}.out32.c{c}" / "burst.h5")


def assert_same(whole, streamed) -> None:
    """Every result column equal (NaN equal to NaN; an int column may come back wider: a chunk
    without a flip holds its -1s as int64), every note, the flip test."""
    assert whole.columns.keys() == streamed.columns.keys()
    for name, col in whole.columns.items():
        other = streamed.columns[name]
        assert col.dtype.kind == other.dtype.kind and col.shape == other.shape, name
        if col.dtype.kind == "f":
            np.testing.assert_array_equal(col, other, err_msg=name)
        else:
            assert col.tolist() == other.tolist(), name
    assert whole.notes == streamed.notes
    assert whole.flip_test == streamed.flip_test


@pytest.mark.parametrize("positions", [1, 40, 100, 200])
def test_streamed_demo_diff_is_the_whole_diff(positions):
    """The demo's c8 bursts against their serial runs, calibrated on the c4 bursts: every
    chunk size gives the whole diff's verdicts, rule texts and run-level flip test."""
    cal = measure([_demo("code16", 4)], "demo-c4", eos=(0,))
    for prompts in ("code16", "prefix8"):
        a, b = _demo(prompts, 8)
        with TraceReader(a) as ra, TraceReader(b) as rb:
            assert stream.streams(ra, rb, positions)  # both longer than a chunk
        whole = diff(a, b, eos=(0,), calibration=cal, stream_positions=None)
        assert whole.flip_test is not None
        assert_same(whole, diff(a, b, eos=(0,), calibration=cal, stream_positions=positions))


META = RunMeta(source="http", run={"eos_token_ids": [2], "dtype": "bf16"}, layout=Layout(topk=4, raw_logits=True))


def _request(w, key: str, n: int, rng, status: str = "ok", flip_at: int | None = None, misorder: bool = False):
    tok = (100 + np.arange(n)).astype(np.int32)
    logit = np.tile(np.float32([20.0, 19.875, 18.0, 17.0]), (n, 1))  # top-2 one BF16 step apart
    ids = np.stack([tok, tok + 1000, tok + 2000, tok + 3000], 1).astype(np.int32)
    if flip_at is not None and flip_at < n:  # a near tie that went the other way
        tok[flip_at] = ids[flip_at, 1]
        ids[flip_at, :2] = ids[flip_at, 1], ids[flip_at, 0]
        logit[flip_at, 1] = 20.0
    lp = (logit - np.log(np.exp(logit.astype(np.float64)).sum(1, keepdims=True) + 0.01)).astype(np.float32)
    lp += rng.normal(0, 1e-5, lp.shape).astype(np.float32)
    lp[:, 1:] = np.minimum(lp[:, 1:], lp[:, :-1])  # keep rows sorted
    if misorder:  # an engine's top-k out of order at its last row (reported.py reads that row again)
        lp[-1, 2] = lp[-1, 1] + 0.5
    tc = TokenColumns(tok, lp[:, 0].copy(), np.zeros(n), ids, lp, logit)
    rec = RequestRecord(key=key, prompt_hash="p", status=status, finish_reason="length", history="", dtype="")
    w.append(rec, tc, np.arange(6, dtype=np.int32), flush=False)


def _traces(tmp_path):
    """A: r0..r29. B: the same keys in reverse order, r3 missing, x0/x1 only in B, r7 failed,
    tie flips in a few requests, r11's last top-k row out of order."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 40, 30)
    pa, pb = tmp_path / "a.h5", tmp_path / "b.h5"
    with TraceWriter(pa, META) as w:
        for i, n in enumerate(lens.tolist()):
            _request(w, f"r{i}", n, rng)
    with TraceWriter(pb, META) as w:
        for i in reversed(range(30)):
            if i == 3:
                continue
            flip = int(lens[i]) // 2 if i % 4 == 1 else None
            _request(w, f"r{i}", int(lens[i]), rng, status="error" if i == 7 else "ok", flip_at=flip, misorder=i == 11)
            if i == 20:
                _request(w, "x0", 9, rng)
        _request(w, "x1", 5, rng)
    return str(pa), str(pb)


def _with_repeat(tmp_path, pb: str) -> str:
    """B again, with r5 answered a second time (ok): an ambiguous key."""
    out = tmp_path / "b2.h5"
    with TraceReader(pb) as r, TraceWriter(out, r.meta) as w:
        for i in range(len(r)):
            w.append(r.record(i), r.tokens(i), r.prompt_ids(i), flush=False)
        rec = r.record(int(np.flatnonzero(r.requests.key == "r5")[0]))
        w.append(dataclasses.replace(rec, history="again"), r.tokens(0), np.arange(6, dtype=np.int32))
    return str(out)


@pytest.mark.parametrize("positions", [1, 7, 37, 200])
def test_streamed_diff_survives_what_breaks_chunks(tmp_path, positions):
    pa, pb = _traces(tmp_path)
    pb2 = _with_repeat(tmp_path, pb)
    for b in (pb, pb2):
        whole = diff(pa, b, stream_positions=None)
        streamed = diff(pa, b, stream_positions=positions)
        assert_same(whole, streamed)
        c = whole.counts()
        assert c["incomparable"] >= 4 and c["bf16_tie_flip"] >= 5  # r3, r7, x0, x1 (+ r5 in b2); the flips
        assert "not sorted by logprob" in streamed.columns["rule"][11]  # r11's misreported row, read again
    keys = diff(pa, pb2, stream_positions=positions).columns["key"].tolist()
    assert keys[:30] == [f"r{i}" for i in range(30)] and keys[30:] == ["x0", "x1"]  # A's order, then B's


def test_window_reads_its_runs_and_cuts_blocks_at_chunk_edges(tmp_path):
    pa, _ = _traces(tmp_path)
    with TraceReader(pa) as r:
        whole = r.column("topk_logprob")
        off = r.requests.token_offset[[2, 3, 9, 20]].astype(np.int64)
        n = r.requests.n_tokens[[2, 3, 9, 20]].astype(np.int64)
        starts, ends = runs(off, n, gap=0)
        assert len(starts) == 3  # rows 2 and 3 are one run
        w = Window(r, starts, ends)
        want = np.concatenate([whole[s:e] for s, e in zip(starts, ends)])
        np.testing.assert_array_equal(w.column("topk_logprob"), want)
        np.testing.assert_array_equal(w.column("topk_logprob", slice(3, w.n_token_rows - 2)), want[3:-2])
        rows = np.array([w.n_token_rows - 1, 0, 5])
        np.testing.assert_array_equal(w.rows("topk_logprob", rows), want[rows])
        blocks = w.blocks(8)
        assert sum(e - s for s, e in blocks) == w.n_token_rows
        file_starts = [int(w.to_file(np.array([s]))[0]) for s, _ in blocks]
        assert all(f % 8 == 0 or f in starts.tolist() for f in file_starts)  # a block starts at a chunk edge or a run
