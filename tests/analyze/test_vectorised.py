"""The diff's vectorised parts equal the per-pair code they replace, on planted traces with every
class and on edge cases (an EOS before the flip, empty streams, NaN logprobs, ties, every finish
reason, max_tokens and ignore_eos combination): the rule texts of identical pairs
(rules.rule_texts), the streams' completeness (streams.complete, classify._streams) and the drift
reduced over a gather of a few pairs' rows (positions.drift). A vectorised shortcut that drifts
from the per-pair wording or numbers changes a verdict's text or a JSON number silently."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tracekit.analyze import classify as classify_mod
from tracekit.analyze import compare as compare_mod
from tracekit.analyze import diff, positions
from tracekit.analyze import rules as rules_mod
from tracekit.analyze.streams import context_limited, truncation
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import diff_bench  # noqa: E402

K, EOS = 4, 2


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The bench's traces (every class planted), 20k positions."""
    d = tmp_path_factory.mktemp("planted")
    rng = np.random.default_rng(5)
    cols, lens, cls = diff_bench.synth(20_000, seed=5)
    b, cached_a, cached_b, status_b = diff_bench.plant(cols, lens, cls, rng)
    pa, pb = str(d / "a.h5"), str(d / "b.h5")
    diff_bench.write(pa, cols, lens, cached_a, np.full(len(lens), "ok", dtype=object))
    diff_bench.write(pb, b, lens, cached_b, status_b)
    return pa, pb


def _row(tok: int, lp: float = -0.1) -> tuple[list[int], list[float], list[float]]:
    ids = [tok] + [t for t in (40, 41, 42, 43) if t != tok][: K - 1]
    return ids, [lp, -3.5, -4.0, -5.0], [20.0, 16.5, 16.0, 15.0]


def _edge_trace(path: str, side: str) -> str:
    """Requests that reach every branch of truncation() and of the drift: finish reasons (stop,
    length, '', context limit, an odd one), short and full lengths, ignore_eos and stop strings,
    an empty stream, NaN logprob columns, an EOS before the flip, a tie flip."""
    reqs = []
    fins = ["stop", "length", "", "context_limit", "weird", "eos", "max_tokens", "stop"]
    for i in range(40):
        fin = "context_limit" if side == "b" and i % 11 == 2 else fins[i % len(fins)]  # one side only too
        n = 0 if i % 13 == 5 else 6 + i % 7
        params = {"max_tokens": 8 + (i % 3) * 2, "temperature": 0}
        if i % 4 == 1:
            params["ignore_eos"] = True
        if i % 6 == 2:
            params["stop"] = ["\n"]
        toks = [3 + (j * 7 + i) % 30 for j in range(n)]
        lp = np.full(n, -0.1, np.float32) - 0.01 * np.arange(n, dtype=np.float32)
        if i % 5 == 3 and n > 2:
            toks[1] = EOS  # an EOS early, a flip after it
        tie = i % 9 == 8 and n > 4
        if side == "b" and n > 4 and i % 3 == 0 and not tie:
            toks[4] = toks[4] + 1  # a flip (after the EOS where there is one)
        if side == "b" and n:
            lp = lp + np.float32(1e-3 * (i % 4))  # drift of several sizes
        if i % 7 == 4 and n:
            lp[: n // 2] = np.nan  # a column without some logprobs (the top-k row says them)
        rows = [_row(t, float(x) if np.isfinite(x) else -0.1) for t, x in zip(toks, lp)]
        ids = np.array([r[0] for r in rows], np.int32).reshape(n, K)
        lps = np.array([r[1] for r in rows], np.float32).reshape(n, K)
        logit = np.array([r[2] for r in rows], np.float32).reshape(n, K)
        if tie:  # a tie flip at 4: A's and B's top-2 swapped, one BF16 step (1/8 at 20) apart
            x, y = toks[4], 40 if toks[4] != 40 else 41
            ids[4, :2] = (x, y) if side == "a" else (y, x)
            lps[4, :2], logit[4, :2] = (-0.69, -0.815), (20.0, 19.875)
            toks[4] = ids[4, 0]
        lp[4:5] = lps[4:5, 0] if tie else lp[4:5]
        tc = TokenColumns(np.array(toks, np.int32), lp, np.zeros(n), ids, lps, logit)
        rec = RequestRecord(key=f"k{i:03d}", prompt_hash="p", finish_reason=fin, params=json.dumps(params))
        reqs.append((rec, tc, np.arange(8, dtype=np.int32)))
    meta = RunMeta(source="http", run={"eos_token_ids": [EOS], "dtype": "bf16"}, layout=Layout(topk=K, raw_logits=True))
    with TraceWriter(path, meta, journal=False) as w:
        w.append_many(reqs, flush=True)
    return path


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    d = tmp_path_factory.mktemp("edges")
    return _edge_trace(str(d / "a.h5"), "a"), _edge_trace(str(d / "b.h5"), "b")


def _per_pair_streams(al, comparable, eos_pos):
    """classify._streams as it was: truncation() for every comparable pair."""
    P = len(al.keys)
    trunc_a, trunc_b = np.full(P, "", dtype=object), np.full(P, "", dtype=object)
    for i in np.flatnonzero(comparable).tolist():
        trunc_a[i] = truncation(al.a, int(al.row_a[i]), int(al.n_a[i]), al.asked_a[i])
        trunc_b[i] = truncation(al.b, int(al.row_b[i]), int(al.n_b[i]), al.asked_b[i])
    return trunc_a, trunc_b


def _per_pair_context(al) -> list[tuple[bool, bool]]:
    """streams.context_notes's test as it was: context_limited() of each pair's two rows."""
    return [
        (context_limited(al.a, int(al.row_a[i])), context_limited(al.b, int(al.row_b[i]))) for i in range(len(al.keys))
    ]


def _per_pair_drift(al, end, v):
    """positions.drift as it was: every pair reduced over the whole [T], masked by position."""
    P = len(end)
    dmax, mean, raw_max = np.full(P, np.nan), np.full(P, np.nan), np.full(P, np.nan)
    n, nf, inc = (np.zeros(P, np.int64) for _ in range(3))
    nfa, nfb = np.full(P, np.nan), np.full(P, np.nan)
    bitwise = np.ones(P, bool)
    nz = np.flatnonzero(al.length > 0)
    starts = al.start[nz]
    pre = al.pos < al.per_row(end)
    both = v.finite & pre
    n[nz] = np.add.reduceat(both, starts, dtype=np.int64)
    dmax[nz] = np.maximum.reduceat(np.where(both, v.delta, -1.0), starts)
    mean[nz] = np.add.reduceat(np.where(both, v.delta, 0.0), starts) / np.maximum(n[nz], 1)
    raw_max[nz] = np.maximum.reduceat(np.where(both, v.raw, -1.0), starts)
    dmax[n == 0], mean[n == 0], raw_max[n == 0] = np.nan, np.nan, np.nan

    def first(mask):
        hit = np.flatnonzero(mask)
        pos, idx = np.full(P, -1, np.int64), np.full(P, -1, np.int64)
        segs, at = np.unique(al.seg[hit], return_index=True)
        pos[segs], idx[segs] = al.pos[hit[at]], hit[at]
        return pos, idx

    odd = v.odd & pre
    nf[nz] = np.add.reduceat(odd, starts, dtype=np.int64)
    nf_pos, idx = first(odd)
    has = idx >= 0
    nfa[has], nfb[has] = v.lp_a[idx[has]], v.lp_b[idx[has]]
    bad = v.inconsistent & pre
    inc[nz] = np.add.reduceat(bad, starts, dtype=np.int64)
    inc_pos, inc_idx = first(bad)
    said = np.full((P, 3), np.nan)
    has = inc_idx >= 0
    said[has] = v.said[np.searchsorted(v.said_at, inc_idx[has])]
    bitwise[nz] = np.add.reduceat(v.differ & pre, starts, dtype=np.int64) == 0
    return positions.Drift(dmax, mean, n, nf, nf_pos, nfa, nfb, inc, inc_pos, said, bitwise, raw_max)


@pytest.mark.parametrize("case", ["planted", "edges"])
def test_vectorised_equals_per_pair(case, request, monkeypatch):
    pa, pb = request.getfixturevalue(case)
    seen = {"texts": 0, "streams": 0, "drift": 0, "gathered": 0}
    real_texts, real_streams, real_drift = rules_mod.rule_texts, classify_mod._streams, classify_mod.drift

    def texts(f, j):
        got = real_texts(f, j)
        assert got.dtype == object and got.tolist() == [rules_mod.rule_text(f, j, i) for i in range(len(f.key))]
        seen["texts"] += int((j.cls == "identical").sum())
        return got

    def streams(al, comparable, eos_pos):
        got = real_streams(al, comparable, eos_pos)
        want = _per_pair_streams(al, comparable, eos_pos)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
        seen["streams"] += int(comparable.sum())
        return got

    def drift(al, end, v, skip=False):
        got = real_drift(al, end, v, skip)
        if not skip:
            want = _per_pair_drift(al, end, v)
            for name in got.__dataclass_fields__:
                x, y = getattr(got, name), getattr(want, name)
                assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
            nz = np.flatnonzero((al.length > 0) & (end > 0))
            seen["drift"] += 1
            seen["gathered"] += int(2 * al.length[nz].sum() < len(al.pos))
        return got

    real_context = compare_mod.context_notes

    def context(al):
        per, lines = real_context(al)
        want = _per_pair_context(al)
        assert [bool(x) for x in per] == [a or b for a, b in want]
        assert all(("both" in x) == (a and b) for x, (a, b) in zip(per, want) if x)
        seen["context"] = sum(a or b for a, b in want)
        return per, lines

    monkeypatch.setattr(compare_mod, "context_notes", context)
    monkeypatch.setattr(classify_mod, "rule_texts", texts)
    monkeypatch.setattr(classify_mod, "_streams", streams)
    monkeypatch.setattr(classify_mod, "drift", drift)
    r = diff(pa, pb)
    counts = r.counts()
    assert seen["texts"] >= counts["identical"] > 0  # (the reported-row checks may refute some after)
    assert seen["streams"] == len(r) - counts["incomparable"]
    assert seen["drift"] == 2 and seen["gathered"] == 1  # the drift up to an EOS: a gather of a few pairs
    if case == "edges":  # the edge cases reach what they are meant to
        trunc = [x for x in r.columns["trunc_a"].tolist() + r.columns["trunc_b"].tolist() if x]
        assert any("without a finish reason" in x for x in trunc) and any("'weird'" in x for x in trunc)
        assert any("finish_reason length after" in x for x in trunc)
        assert any("although EOS was ignored" in x for x in trunc)
        assert (r.columns["eos_pos"] >= 0).any() and (r.columns["compared"] == 0).any()
        assert (r.columns["drift_n"] < r.columns["compared"]).any()  # NaN columns: fewer positions
        notes = [x for x in r.columns["note"].tolist() if "context limit" in x]
        assert any(x.startswith("both") for x in notes) and any(x.startswith("B truncated") for x in notes)
        assert seen["context"] == len(notes)
