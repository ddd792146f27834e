"""Every class and every rule boundary of the divergence taxonomy, on traces
built by hand through the real store (analyze_builders.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from analyze_builders import EOS, Req, flip, write_trace

from analyze import Thresholds, bf16_ulp, diff
from tracekit.errors import AlignmentError, ConfigError

BASE = [5, 6, 7, 8, 9, 10]


def one(tmp_path, ra: Req, rb: Req, k: int = 5, raw: bool = False, kb: int | None = None, raw_b=None, **kw):
    """Diff one pair (plus an identical anchor pair) and return the pair's result."""
    anchor = Req("anchor", [5, 6])
    a = write_trace(tmp_path / "a.h5", [anchor, ra], k=k, raw=raw)
    b = write_trace(tmp_path / "b.h5", [anchor, rb], k=kb or k, raw=raw if raw_b is None else raw_b)
    r = diff(a, b, **kw)
    assert r.by_key("anchor").cls == "identical"
    return r.by_key(ra.key)


def with_flip(tokens, t, b_tok):
    out = list(tokens)
    out[t] = b_tok
    return out


# -- identical -----------------------------------------------------------------


def test_identical_bitwise(tmp_path):
    p = one(tmp_path, Req("k", BASE), Req("k", BASE))
    assert (p.cls, p.bitwise, p.drift_max, p.drift_mean, p.vllm_close) == ("identical", True, 0.0, 0.0, True)
    assert p.position is None and p.rule.startswith("same 6 token ids")


def test_identical_reports_drift(tmp_path):
    """Same ids but different logprobs: still identical, with the drift as evidence."""
    p = one(tmp_path, Req("k", BASE, lp={1: -0.5, 3: -0.25}), Req("k", BASE))
    assert p.cls == "identical" and not p.bitwise
    assert p.drift_max == pytest.approx(0.49) and p.drift_mean == pytest.approx((0.49 + 0.24) / 6)


# -- post_eos --------------------------------------------------------------------


def test_flip_right_after_eos_is_post_eos(tmp_path):
    a = [5, EOS, 7, 8]
    p = one(tmp_path, Req("k", a), Req("k", with_flip(a, 2, 9)))
    assert (p.cls, p.position, p.token_a, p.token_b) == ("post_eos", 2, 7, 9)
    assert "EOS at 1" in p.rule


def test_flip_at_the_eos_position_is_not_post_eos(tmp_path):
    """A flip AT the EOS (B did not stop) is judged by the tie rule, not excused."""
    a = [5, 6, EOS]
    ra = Req("k", a, rows={2: flip(EOS, 9, -0.5, -0.55)})
    rb = Req("k", with_flip(a, 2, 9), rows={2: flip(9, EOS, -0.5, -0.55)})
    assert one(tmp_path, ra, rb).cls == "bf16_tie_flip"
    ra = Req("k", a, rows={2: flip(EOS, 9, -0.1, -3.0)})
    rb = Req("k", with_flip(a, 2, 9), rows={2: flip(9, EOS, -0.1, -3.0)})
    assert one(tmp_path, ra, rb).cls == "unexplained"


def test_eos_at_last_position_and_longer_b_is_post_eos(tmp_path):
    """A stopped at EOS (its last token); B ignored EOS and went on: the difference is after EOS."""
    p = one(tmp_path, Req("k", [5, 6, EOS], finish="stop"), Req("k", [5, 6, EOS, 8, 9]))
    assert (p.cls, p.position, p.token_a, p.token_b, p.len_a, p.len_b) == ("post_eos", 3, None, 8, 3, 5)


def test_eos_inferred_from_stop_rows_when_metadata_has_none(tmp_path):
    anchor = Req("anchor", [5, 6])
    a = write_trace(tmp_path / "a.h5", [anchor, Req("s", [5, 77], finish="stop"), Req("k", [5, 77, 8])], eos=None)
    b = write_trace(tmp_path / "b.h5", [anchor, Req("s", [5, 77], finish="stop"), Req("k", [5, 77, 9])], eos=None)
    r = diff(a, b)
    assert r.eos_ids == (77,) and "inferred" in r.eos_source
    assert r.by_key("k").cls == "post_eos"
    r = diff(a, b, eos=[3])  # an explicit id replaces the inference
    assert r.eos_ids == (3,) and r.by_key("k").cls == "unexplained"


# -- bf16_tie_flip, logprobs only --------------------------------------------------


@pytest.mark.parametrize("lp_other,expect", [(-0.625, "bf16_tie_flip"), (-0.6250001, "unexplained")])
def test_tie_nats_boundary_is_inclusive(tmp_path, lp_other, expect):
    """A gap of exactly --tie-nats (0.125, exact in binary) is a tie; one float32 step more is not."""
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.5, lp_other)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -0.625)})
    p = one(tmp_path, ra, rb)
    assert p.cls == expect
    assert p.gap_a == -0.5 - float(np.float32(lp_other)) and p.gap_b == 0.125  # float32 inputs, exact math
    assert p.gap_a_ulp is None and p.vllm_close is True and p.topk_overlap == 1.0


def test_tie_nats_option_moves_the_boundary(tmp_path):
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.5, -0.7)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -0.7)})
    assert one(tmp_path, ra, rb).cls == "unexplained"
    assert one(tmp_path, ra, rb, tie_nats=0.2).cls == "bf16_tie_flip"


# -- bf16_tie_flip, raw logits (ULPs) ---------------------------------------------


def test_bf16_ulp_formula():
    assert bf16_ulp(np.array([1.0, 4.0, 5.9, 8.0, -8.5, 0.3])).tolist() == [2**-7, 2**-5, 2**-5, 2**-4, 2**-4, 2**-9]


@pytest.mark.parametrize("logit_other,expect,ulps", [(3.875, "bf16_tie_flip", 4.0), (3.84375, "unexplained", 5.0)])
def test_tie_ulps_boundary_is_inclusive(tmp_path, logit_other, expect, ulps):
    """At |logit| 4 the BF16 ULP is 1/32: a gap of exactly 4 ULPs is a tie, 5 is not
    (the logprob gap, 0.3 nats, is ignored when raw logits exist)."""
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.5, -0.8, 4.0, logit_other)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -0.8, 4.0, 3.875)})
    p = one(tmp_path, ra, rb, raw=True)
    assert (p.cls, p.gap_a_ulp, p.gap_b_ulp) == (expect, ulps, 4.0)
    assert p.gap_a == pytest.approx(0.3)


def test_logprobs_only_vs_raw_logits(tmp_path):
    """The same flip: a tie in ULPs when logits exist, not a tie in nats without them;
    with logits on one side only, each side is judged with what it has."""
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.5, -0.8, 4.0, 3.9375)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -0.8, 4.0, 3.9375)})
    assert one(tmp_path, ra, rb, raw=True).cls == "bf16_tie_flip"
    assert one(tmp_path, ra, rb, raw=False).cls == "unexplained"
    mixed = one(tmp_path, ra, rb, raw=True, raw_b=False)
    assert mixed.gap_a_ulp == 2.0 and mixed.gap_b_ulp is None and mixed.cls == "unexplained"
    assert one(tmp_path, ra, rb, raw=True, raw_b=False, tie_nats=0.31).cls == "bf16_tie_flip"


def test_tie_with_large_drift_before_is_unexplained(tmp_path):
    """A near-tie flip after the chosen logprobs already moved by > --drift-nats is not benign."""
    ra = Req("k", BASE, lp={1: -1.0}, rows={2: flip(7, 99, -0.5, -0.55)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -0.55)})
    p = one(tmp_path, ra, rb)
    assert p.cls == "unexplained" and p.drift_max == pytest.approx(0.99) and "drift" in p.rule
    assert one(tmp_path, ra, rb, drift_nats=1.0).cls == "bf16_tie_flip"


# -- cache_boundary ------------------------------------------------------------------


@pytest.mark.parametrize(
    "lp_other,cached_b,expect",
    [
        (-0.8, 8, "cache_boundary"),  # 0.3 nats: beyond tie, within drift
        (-1.0, 8, "cache_boundary"),  # exactly the drift tolerance (0.5)
        (-1.0000001, 8, "unexplained"),  # just beyond it
        (-0.8, 16, "unexplained"),  # same boundary on both sides
        (-0.8, -1, "unexplained"),  # B's boundary unknown: not "different"
    ],
)
def test_cache_boundary_rule(tmp_path, lp_other, cached_b, expect):
    ra = Req("k", BASE, cached=16, rows={2: flip(7, 99, -0.5, lp_other)})
    rb = Req("k", with_flip(BASE, 2, 99), cached=cached_b, rows={2: flip(99, 7, -0.5, -0.6)})
    p = one(tmp_path, ra, rb)
    assert p.cls == expect and (p.boundary_a, p.boundary_b) == (16, None if cached_b < 0 else cached_b)


def test_tie_wins_over_cache_boundary(tmp_path):
    ra = Req("k", BASE, cached=16, rows={2: flip(7, 99, -0.5, -0.55)})
    rb = Req("k", with_flip(BASE, 2, 99), cached=0, rows={2: flip(99, 7, -0.5, -0.55)})
    assert one(tmp_path, ra, rb).cls == "bf16_tie_flip"


# -- unexplained ------------------------------------------------------------------------


def test_token_outside_topk_is_unexplained_and_fails_vllm_rule(tmp_path):
    p = one(tmp_path, Req("k", BASE), Req("k", with_flip(BASE, 3, 4242)))
    assert (p.cls, p.position, p.vllm_close, p.b_in_topk_a) == ("unexplained", 3, False, False)
    assert p.gap_a == pytest.approx(9.0 - 0.01, abs=1e-6)  # lower bound: to the lowest top-k entry
    assert "not in A's top-k" in p.rule


def test_different_lengths_without_eos_is_unexplained(tmp_path):
    p = one(tmp_path, Req("k", BASE), Req("k", BASE[:4]))
    assert (p.cls, p.position, p.len_a, p.len_b, p.token_a, p.token_b) == ("unexplained", 4, 6, 4, 9, None)
    assert "length mismatch" in p.rule and p.vllm_close is True


def test_different_topk_widths(tmp_path):
    """A logs top-3, B top-8: overlap is over the narrower width; B's token at A's rank 2 still counts."""
    ra = Req("k", BASE, rows={2: [(7, -0.5), (99, -0.55), (50, -3.0)]})
    rb = Req(
        "k",
        with_flip(BASE, 2, 99),
        rows={2: [(99, -0.5), (7, -0.55), (51, -3.0)] + [(60 + i, -4.0 - i) for i in range(5)]},
    )
    p = one(tmp_path, ra, rb, k=3, kb=8)
    assert p.cls == "bf16_tie_flip" and p.topk_overlap == pytest.approx(2 / 3)


# -- incomparable -----------------------------------------------------------------------


def test_missing_keys_and_failures_are_incomparable(tmp_path):
    a = write_trace(
        tmp_path / "a.h5",
        [
            Req("x", BASE),
            Req("onlya", BASE),
            Req("err", BASE),
            Req("p", BASE),
            Req("plen", BASE),
            Req("h", BASE, prompt=None, phash="h1"),
        ],
    )
    b = write_trace(
        tmp_path / "b.h5",
        [
            Req("x", BASE),
            Req("onlyb", BASE),
            Req("err", [], status="error"),
            Req("p", BASE, prompt=(11, 12, 13, 15)),
            Req("plen", BASE, prompt=(11, 12)),
            Req("h", BASE, prompt=None, phash="h2"),
        ],
    )
    r = diff(a, b)
    rules = {p.key: (p.cls, p.rule) for p in r.pairs}
    assert [p.key for p in r.pairs] == ["x", "onlya", "err", "p", "plen", "h", "onlyb"]
    assert all(c == "incomparable" for k, (c, _) in rules.items() if k != "x")
    assert rules["onlya"][1] == "missing in B" and rules["onlyb"][1] == "missing in A"
    assert rules["err"][1].startswith("B status error HTTP 500")
    assert rules["p"][1] == "different prompts: token ids differ at prompt position 3"
    assert rules["plen"][1] == "different prompts: 4 vs 2 tokens"
    assert "prompt_hash" in rules["h"][1]
    assert not r.ok and r.counts()["incomparable"] == 6


def test_no_common_key_is_an_error(tmp_path):
    a = write_trace(tmp_path / "a.h5", [Req("x", BASE)])
    b = write_trace(tmp_path / "b.h5", [Req("y", BASE)])
    with pytest.raises(AlignmentError, match="no request key in common"):
        diff(a, b)


def test_empty_traces_and_same_file_are_errors(tmp_path):
    """A comparison that compares nothing fails loudly instead of printing 0/0."""
    a = write_trace(tmp_path / "a.h5", [])
    b = write_trace(tmp_path / "b.h5", [])
    with pytest.raises(AlignmentError, match="nothing to compare"):
        diff(a, b)
    c = write_trace(tmp_path / "c.h5", [Req("x", BASE)])
    with pytest.raises(ConfigError, match="same file"):
        diff(c, c)


def test_thresholds_are_validated():
    with pytest.raises(ConfigError, match="drift-nats"):
        Thresholds(tie_nats=0.5, drift_nats=0.1)
    with pytest.raises(ConfigError, match="tie-ulps"):
        Thresholds(tie_ulps=-1)
    assert math.isclose(Thresholds().tie_nats, 4 * 2**-5)  # 4 BF16 ULPs at |logit| in [4, 8)


def test_traces_without_topk_cannot_prove_a_tie(tmp_path):
    """Top-k width 0 (an engine that returns no logprobs): a flip is unexplained, identical stays identical."""
    p = one(tmp_path, Req("k", BASE), Req("k", with_flip(BASE, 1, 99)), k=0)
    assert (p.cls, p.position, p.gap_a, p.vllm_close, p.topk_overlap) == ("unexplained", 1, None, False, None)


def test_side_without_any_tokens_is_incomparable_not_a_crash(tmp_path):
    """Every request of B failed (an engine that rejected the whole burst): B holds no
    token rows at all. Each pair is incomparable and said so; the diff must not crash."""
    a = write_trace(tmp_path / "a.h5", [Req("p0", [5, 6, 7]), Req("p1", [5, 6])])
    b = write_trace(tmp_path / "b.h5", [Req("p0", [], status="error"), Req("p1", [], status="error")])
    r = diff(a, b)
    assert r.counts()["incomparable"] == 2 and not r.ok
