"""TraceWriter.append_many (the capture's group commit) writes exactly what
one append per request writes."""

from __future__ import annotations

import numpy as np
import pytest

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceReader, TraceWriter


@pytest.mark.parametrize("raw", [False, True])
def test_append_many_equals_appends(tmp_path, raw):
    rng = np.random.default_rng(0)
    items = []
    for i in range(6):
        n = 3 * i + 1
        tok = TokenColumns(
            rng.integers(0, 9, n),
            rng.random(n),
            rng.random(n),
            rng.integers(0, 9, (n, 3)),
            rng.random((n, 3)),
            rng.random((n, 3)) if raw and i % 2 else None,
        )
        items.append(
            (
                RequestRecord(key=f"k{i}", prompt_hash="h", error="é" * i, cached_tokens=i - 1),
                None if i == 2 else tok,
                list(range(i)) if i % 2 else None,
            )
        )
    meta = RunMeta(source="http", run={}, layout=Layout(topk=4, raw_logits=raw))
    with TraceWriter(tmp_path / "a.h5", meta) as w:
        for it in items:
            w.append(*it)
    with TraceWriter(tmp_path / "b.h5", meta) as w:
        assert w.append_many(items[:1]) == 1 and w.append_many(items[1:]) == 5
    with TraceReader(tmp_path / "a.h5") as a, TraceReader(tmp_path / "b.h5") as b:
        for c in ("key", "error", "prompt_len", "token_offset", "n_tokens", "prompt_offset", "cached_tokens"):
            assert list(getattr(a.requests, c)) == list(getattr(b.requests, c)), c
        for i in range(6):
            ta, tb = a.tokens(i), b.tokens(i)
            for c in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit"):
                x, y = getattr(ta, c), getattr(tb, c)
                assert (x is None and y is None) or np.array_equal(x, y, equal_nan=True), (i, c)
            pa, pb = a.prompt_ids(i), b.prompt_ids(i)
            assert (pa is None and pb is None) or np.array_equal(pa, pb)
