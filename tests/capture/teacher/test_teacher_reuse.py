"""reuse.py: first segments cut from a longer sibling only where verified bitwise, per shape.

Every test compares the histories' logits with reuse on against reuse off with torch.equal:
the cut is a cost saving and must never change a number.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tracekit.capture.teacher import TeacherConfig, reuse, run_teacher, trie
from tracekit.capture.teacher.history import parse_histories
from tracekit.capture.teacher.model import load_model
from tracekit.capture.teacher.trie import run_histories
from tracekit.store import TraceReader

HISTORIES = "full,prefix:HALF,chunked:HALF,decode"


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def lm(request, fixture_model_dir):
    return load_model(str(fixture_model_dir), request.param)


def _case(lm, n: int, p: int, g: int):
    """(ids [n, p+g-1], first_scored, histories) of one batch; decode's prefill is [0, p)."""
    import torch

    ids = torch.randint(2, lm.vocab_size, (n, p + g), generator=torch.Generator().manual_seed(p))
    specs = parse_histories(HISTORIES.replace("HALF", str(p // 2)))
    return ids[:, :-1], p - 1, [s.resolve(p, g, p // 2) for s in specs]


def _off(lm):
    return dataclasses.replace(lm, reuse_prefixes=False)


def _assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for label in a:
        assert a[label].shape == b[label].shape, label
        assert torch.equal(a[label], b[label]), f"{label}: reuse changed the logits"


@pytest.mark.parametrize(
    "n,p,g",
    [
        (2, 48, 8),  # decode's prefill [0, 48): a multiple of 16; prefix [0, 24)
        (2, 45, 8),  # [0, 45) and [0, 22): not
        (4, 96, 8),  # [0, 96) and [0, 48) of [0, 103)
    ],
)
def test_reuse_gives_the_logits_without_reuse(lm, n, p, g):
    ids, first, hists = _case(lm, n, p, g)
    off = run_histories(_off(lm), ids, first, hists)
    before = dict(reuse.STATS)
    first_call = run_histories(lm, ids, first, hists)  # verifies this shape's cuts
    _assert_same(first_call, off)
    verdicts = {k: v for k, v in lm.prefix_verdicts.items() if k[4] == n}
    end = p + g - 1
    cuts = {k[5]: v for k, v in verdicts.items() if k[3] == "cut" and k[6] == end}
    assert sorted(cuts) == sorted({p // 2, p})  # both shorter first segments were compared
    assert isinstance(verdicts[(*next(iter(verdicts))[:3], "leaf-with-cache", n, end, g)], bool)  # per machine
    assert reuse.STATS["verified"] - before["verified"] == 3
    mid = dict(reuse.STATS)
    second = run_histories(lm, ids, first, hists)  # cut where True, its own forward where False
    _assert_same(second, off)
    assert reuse.STATS["verified"] == mid["verified"]  # nothing verified twice
    assert reuse.STATS["reused"] - mid["reused"] == sum(cuts.values())


def _recording(monkeypatch) -> list:
    """Patch trie._forward to record (tokens, cached positions before it or None, kept logits) of
    every forward: (b, 0, keep) is a first segment [0, b) run from an empty cache."""
    calls = []
    real = trie._forward

    def forward(lm, ids, cache, keep):
        calls.append((ids.shape[1], None if cache is None else cache.get_seq_length(), keep))
        return real(lm, ids, cache, keep)

    monkeypatch.setattr(trie, "_forward", forward)
    return calls


def test_failed_verification_falls_back_and_is_remembered(lm, monkeypatch):
    ids, first, hists = _case(lm, 2, 64, 8)  # a shape no other test verifies
    off = run_histories(_off(lm), ids, first, hists)
    real = reuse.bitwise_equal
    compared = []

    def differs_for_cuts(a, b):  # the cuts' K/V lists compare unequal; the leaf's logits as usual
        compared.append(len(a))
        return len(a) == 1 and real(a, b)

    monkeypatch.setattr(reuse, "bitwise_equal", differs_for_cuts)
    before = dict(reuse.STATS)
    _assert_same(run_histories(lm, ids, first, hists), off)
    assert reuse.STATS["failed"] - before["failed"] == 2  # [0, 32) and [0, 64) of [0, 71)
    cut_keys = [k for k in lm.prefix_verdicts if k[3] == "cut" and k[4] == 2 and k[6] == 71]
    assert sorted(k[5] for k in cut_keys) == [32, 64]
    assert all(lm.prefix_verdicts[k] is False for k in cut_keys)
    calls = _recording(monkeypatch)
    compared.clear()
    mid = dict(reuse.STATS)
    _assert_same(run_histories(lm, ids, first, hists), off)
    assert compared == []  # the verdicts are remembered: nothing compared again
    assert reuse.STATS["reused"] == mid["reused"] and reuse.STATS["verified"] == mid["verified"]
    # the fallback: both first segments ran their own forwards from an empty cache
    assert (32, 0, 0) in calls and (64, 0, 1) in calls
    assert (71, 0, 8) in calls  # full, with a cache (its leaf check passed), only once
    assert sum(c[0] == 71 for c in calls) == 1


def test_verdict_is_cached_and_the_cut_skips_the_forward(lm, monkeypatch):
    ids, first, hists = _case(lm, 4, 96, 8)
    run_histories(lm, ids, first, hists)  # verified here, or already by the test above
    verdicts = dict(lm.prefix_verdicts)
    compared = []
    real = reuse.bitwise_equal
    monkeypatch.setattr(reuse, "bitwise_equal", lambda a, b: compared.append(1) or real(a, b))
    calls = _recording(monkeypatch)
    run_histories(lm, ids, first, hists)
    assert compared == [] and lm.prefix_verdicts == verdicts
    cut = {k[5]: v for k, v in verdicts.items() if k[3] == "cut" and k[4] == 4 and k[6] == 103}
    for b, ok in cut.items():  # a True verdict runs no [0, b) forward; a False one does
        assert any(c[:2] == (b, 0) for c in calls) != ok, (b, ok, calls)


def test_verdicts_are_per_attention_implementation(lm):
    """The attention modules read config._attn_implementation at every forward (the bench's
    numerics switches it): a verdict under one implementation is never used under another."""
    ids, first, hists = _case(lm, 2, 48, 8)
    run_histories(lm, ids, first, hists)
    model = lm.model
    loaded = model.config._attn_implementation
    try:
        model.config._attn_implementation = "eager"
        off = run_histories(_off(lm), ids, first, hists)
        n = len(lm.prefix_verdicts)
        _assert_same(run_histories(lm, ids, first, hists), off)
        assert len(lm.prefix_verdicts) == n + 3
        assert {k[0] for k in lm.prefix_verdicts} >= {loaded, "eager"}
    finally:
        model.config._attn_implementation = loaded


def test_diagnostic_reports_reuse_and_the_flag_turns_it_off(fixture_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": [5 + i] * 96}) + "\n" for i in range(4)))
    rows = {}
    for off in (False, True):
        out = tmp_path / f"diag_{off}.h5"
        s = run_teacher(
            TeacherConfig(
                model_dir=str(fixture_model_dir),
                prompts=str(prompts),
                max_tokens=8,
                history="full,prefix:48,chunked:48,decode",
                dtype="fp32",
                out=str(out),
                no_prefix_reuse=off,
            )
        )
        d = s.as_dict()["prefix_segments"]
        if off:
            assert d == {"reused": 0, "verified": 0, "failed": 0}
        else:  # a fresh model: each batch shape's first segments verified once (leaf + cuts)
            assert d["verified"] >= 2 and d["failed"] <= d["verified"]
        with TraceReader(out) as r:
            assert r.meta.run["prefix_reuse"] is (not off)
            rows[off] = [r.tokens(i) for i in range(len(r.requests))]
    for a, b in zip(rows[False], rows[True], strict=True):
        assert (a.token_id == b.token_id).all()
        assert a.logprob.tobytes() == b.logprob.tobytes()
        assert a.topk_logit.tobytes() == b.topk_logit.tobytes()
