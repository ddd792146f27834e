"""Every class and every rule boundary of the divergence taxonomy, on traces
built by hand through the real store (analyze_builders.py). The bugs each
benign rule must not excuse are in test_soundness.py; the grid in test_grid.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.analyze_builders import EOS, Req, flip, logit_row, write_trace

from tracekit.analyze import Thresholds, diff
from tracekit.errors import AlignmentError, ConfigError

BASE = [5, 6, 7, 8, 9, 10]
BF16 = {"dtype": "bf16"}


def one(tmp_path, ra: Req, rb: Req, k: int = 5, raw: bool = False, kb: int | None = None, raw_b=None, **kw):
    """Diff one pair (plus an identical anchor pair) and return the pair's result."""
    anchor = Req("anchor", [5, 6])
    run = kw.pop("run", BF16)
    a = write_trace(tmp_path / "a.h5", [anchor, ra], k=k, raw=raw, run=run)
    b = write_trace(tmp_path / "b.h5", [anchor, rb], k=kb or k, raw=raw if raw_b is None else raw_b, run=run)
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
    assert p.position is None and p.rule.startswith("same 6 token ids") and p.drift_n == 6


def test_identical_reports_drift(tmp_path):
    """Same ids, logprobs moved within tolerance: identical, with the drift as evidence."""
    p = one(tmp_path, Req("k", BASE, lp={1: -0.5, 3: -0.25}), Req("k", BASE))
    assert p.cls == "identical" and not p.bitwise
    assert p.drift_max == pytest.approx(0.49) and p.drift_mean == pytest.approx((0.49 + 0.24) / 6)
    assert "drift max 0.49 / mean 0.122 nats over 6 positions <= 0.5 / 0.135" in p.rule


# -- post_eos --------------------------------------------------------------------


def test_flip_right_after_eos_is_post_eos(tmp_path):
    a = [5, EOS, 7, 8]
    p = one(tmp_path, Req("k", a), Req("k", with_flip(a, 2, 9)))
    assert (p.cls, p.position, p.token_a, p.token_b) == ("post_eos", 2, 7, 9)
    assert "EOS (id 2) at 1 before the first difference at 2" in p.rule
    # B's token is far outside A's top-k: benign (after EOS), but said.
    assert p.note and "more than numeric noise" in p.note


def test_flip_at_the_eos_position_is_not_post_eos(tmp_path):
    """A flip AT the EOS (B did not stop) is judged by the tie rule, not excused."""
    a = [5, 6, EOS]
    ra = Req("k", a, rows={2: flip(EOS, 9, -0.7, -0.75)})
    rb = Req("k", with_flip(a, 2, 9), rows={2: flip(9, EOS, -0.7, -0.75)})
    assert one(tmp_path, ra, rb).cls == "bf16_tie_flip"
    ra = Req("k", a, rows={2: flip(EOS, 9, -0.1, -3.0)})
    rb = Req("k", with_flip(a, 2, 9), rows={2: flip(9, EOS, -0.1, -3.0)})
    assert one(tmp_path, ra, rb).cls == "unexplained"


def test_eos_at_last_position_and_longer_b_is_post_eos(tmp_path):
    """A stopped at EOS (its last token); B ignored EOS and went on: the difference is after EOS."""
    p = one(tmp_path, Req("k", [5, 6, EOS], finish="stop"), Req("k", [5, 6, EOS, 8, 9]))
    assert (p.cls, p.position, p.token_a, p.token_b, p.len_a, p.len_b) == ("post_eos", 3, None, 8, 3, 5)


def test_eos_is_never_inferred_from_stop_rows(tmp_path):
    """No EOS id in the metadata: a stop row's last token is NOT taken as EOS (a stop
    string is not an EOS); post_eos cannot fire, and the result says how to fix it."""
    anchor = Req("anchor", [5, 6])
    a = write_trace(tmp_path / "a.h5", [anchor, Req("s", [5, 77], finish="stop"), Req("k", [5, 77, 8])], eos=None)
    b = write_trace(tmp_path / "b.h5", [anchor, Req("s", [5, 77], finish="stop"), Req("k", [5, 77, 9])], eos=None)
    r = diff(a, b)
    assert r.eos_ids == () and r.eos_source.startswith("unknown: post_eos cannot fire; pass --eos")
    assert any("EOS ids unknown" in n for n in r.notes)
    assert r.by_key("k").cls == "unexplained"
    r = diff(a, b, eos=[77])  # told: now it is an EOS
    assert r.eos_ids == (77,) and r.eos_source == "--eos" and r.by_key("k").cls == "post_eos"


def test_eos_from_a_model_directory(tmp_path):
    """--tokenizer DIR: EOS ids from the model's own files (generation_config.json)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "generation_config.json").write_text('{"eos_token_id": [77, 78]}')
    a = write_trace(tmp_path / "a.h5", [Req("k", [5, 77, 8])], eos=None)
    b = write_trace(tmp_path / "b.h5", [Req("k", [5, 77, 9])], eos=None)
    r = diff(a, b, tokenizer=str(d))
    assert r.eos_ids == (77, 78) and r.eos_source == f"--tokenizer {d}" and r.pairs[0].cls == "post_eos"


# -- bf16_tie_flip, logprobs only --------------------------------------------------


@pytest.mark.parametrize("lp_other,expect", [(-1.0, "bf16_tie_flip"), (-1.0000001, "unexplained")])
def test_tie_nats_boundary_is_inclusive(tmp_path, lp_other, expect):
    """A gap of exactly --tie-nats (0.5 for bf16, exact in binary) is a tie; one float32 step more is not."""
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.5, lp_other)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.5, -1.0)})
    p = one(tmp_path, ra, rb)
    assert p.cls == expect
    assert p.gap_a == -0.5 - float(np.float32(lp_other)) and p.gap_b == 0.5  # float32 inputs, exact math
    assert p.gap_a_ulp is None and p.vllm_close is True and p.topk_overlap == 1.0


def test_tie_nats_option_moves_the_boundary(tmp_path):
    ra = Req("k", BASE, rows={2: flip(7, 99, -0.7, -1.0)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.7, -1.0)})
    assert one(tmp_path, ra, rb).cls == "bf16_tie_flip"
    p = one(tmp_path, ra, rb, tie_nats=0.2)
    assert p.cls == "unexplained" and "beyond the tie tolerance 0.2 nats" in p.rule


# -- bf16_tie_flip, raw logits (steps of the grid) -----------------------------------


@pytest.mark.parametrize("logit_other,expect,steps", [(4.125, "bf16_tie_flip", 4.0), (4.09375, "unexplained", 5.0)])
def test_tie_ulps_boundary_is_inclusive(tmp_path, logit_other, expect, steps):
    """In [4, 8) the BF16 grid is spaced 1/32: a gap of exactly 4 steps is a tie, 5 is not."""
    ra = Req("k", BASE, rows={2: logit_row([(7, 4.25), (99, logit_other)])})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: logit_row([(99, 4.25), (7, 4.125)])})
    p = one(tmp_path, ra, rb, raw=True)
    assert (p.cls, p.gap_a_ulp, p.gap_b_ulp) == (expect, steps, 4.0)
    assert p.gap_a == pytest.approx(4.25 - logit_other, abs=1e-6)


def test_each_side_is_judged_with_what_it_has(tmp_path):
    """Raw logits on one side only: that side's gap in steps, the other's in nats."""
    ra = Req("k", BASE, rows={2: logit_row([(7, 10.0), (99, 9.875)])})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: logit_row([(99, 10.0), (7, 9.875)])})
    assert one(tmp_path, ra, rb, raw=True).cls == "bf16_tie_flip"
    mixed = one(tmp_path, ra, rb, raw=True, raw_b=False)
    assert mixed.gap_a_ulp == 2.0 and mixed.gap_b_ulp is None and mixed.gap_b == pytest.approx(0.125)
    assert mixed.cls == "bf16_tie_flip" and "A 2 ulp <= 4 ulp, B 0.125 nats <= 0.5 nats" in mixed.rule


def test_tie_with_large_drift_before_is_unexplained(tmp_path):
    """A near-tie flip after the chosen logprobs already moved by > --drift-nats is not benign."""
    ra = Req("k", BASE, lp={1: -1.0}, rows={2: flip(7, 99, -0.7, -0.75)})
    rb = Req("k", with_flip(BASE, 2, 99), rows={2: flip(99, 7, -0.7, -0.75)})
    p = one(tmp_path, ra, rb)
    assert p.cls == "unexplained" and p.drift_max == pytest.approx(0.99)
    assert "logprobs drift 0.99 nats before the flip > 0.5 (bf16)" in p.rule
    assert one(tmp_path, ra, rb, drift_nats=1.0).cls == "bf16_tie_flip"


# -- cache_boundary ------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps,cached_b,expect",
    [
        (8, 8, "cache_boundary"),  # beyond the tie tolerance (4), within the drift tolerance (16)
        (16, 8, "cache_boundary"),  # exactly the drift tolerance
        (17, 8, "unexplained"),  # just beyond it
        (8, 16, "unexplained"),  # same boundary on both sides
        (8, -1, "unexplained"),  # B's boundary unknown: not "different"
    ],
)
def test_cache_boundary_rule(tmp_path, steps, cached_b, expect):
    """Raw logits in [8, 16) (BF16 spacing 1/16): gaps of `steps` steps in both traces."""
    lo = 10.0 - steps / 16
    prompt = tuple(range(11, 31))  # 20 tokens: a boundary must lie inside the prompt
    ra = Req("k", BASE, cached=16, prompt=prompt, rows={2: logit_row([(7, 10.0), (99, lo)])})
    rb = Req("k", with_flip(BASE, 2, 99), cached=cached_b, prompt=prompt, rows={2: logit_row([(99, 10.0), (7, lo)])})
    p = one(tmp_path, ra, rb, raw=True)
    assert p.cls == expect and (p.boundary_a, p.boundary_b) == (16, None if cached_b < 0 else cached_b)
    assert (p.gap_a_ulp, p.gap_b_ulp) == (steps, steps)


def test_cache_boundary_with_logprobs_only(tmp_path):
    """Without logits the tie and drift tolerances are one number (BF16: 0.5 nats), so a flip
    across different reused prefixes is the boundary claim, said in nats (issue 24, item 10: it
    used to be called a tie, with the boundary never mentioned: cache_boundary could not fire on
    a logprob-only engine). A wider drift than tie tolerance gives the same class."""
    prompt = tuple(range(11, 31))
    ra = Req("k", BASE, cached=16, prompt=prompt, rows={2: flip(7, 99, -0.7, -1.0)})
    rb = Req("k", with_flip(BASE, 2, 99), cached=8, prompt=prompt, rows={2: flip(99, 7, -0.7, -1.0)})
    assert one(tmp_path, ra, rb, tie_nats=0.125).cls == "cache_boundary"
    p = one(tmp_path, ra, rb)
    assert p.cls == "cache_boundary" and p.rule.startswith(
        "boundaries 16 vs 8, a numeric-size gap in nats (bf16; no raw logits): |gap| A 0.3 nats <= 0.5 nats"
    ), p.rule


def test_tie_wins_over_cache_boundary(tmp_path):
    """With raw logits a flip within the tie tolerance is a tie whatever the boundaries; in nats
    only, the same flip across a moved boundary is cache_boundary (the test above)."""
    long = tuple(range(11, 43))  # 32 prompt tokens: a 16-token reused prefix is a real boundary
    ra = Req("k", BASE, cached=16, rows={2: flip(7, 99, -0.7, -0.75, 20.0, 19.875)}, prompt=long)
    rb = Req("k", with_flip(BASE, 2, 99), cached=0, rows={2: flip(99, 7, -0.7, -0.75, 20.0, 19.875)}, prompt=long)
    assert one(tmp_path, ra, rb, raw=True).cls == "bf16_tie_flip"
    ra = Req("k", BASE, cached=16, rows={2: flip(7, 99, -0.7, -0.75)}, prompt=long)
    rb = Req("k", with_flip(BASE, 2, 99), cached=0, rows={2: flip(99, 7, -0.7, -0.75)}, prompt=long)
    assert one(tmp_path, ra, rb).cls == "cache_boundary"


# -- unexplained ------------------------------------------------------------------------


def test_token_outside_topk_is_unexplained_and_fails_vllm_rule(tmp_path):
    p = one(tmp_path, Req("k", BASE), Req("k", with_flip(BASE, 3, 4242)))
    assert (p.cls, p.position, p.vllm_close, p.b_in_topk_a) == ("unexplained", 3, False, False)
    assert p.gap_a == pytest.approx(9.0 - 0.01, abs=1e-6)  # lower bound: to the lowest top-k entry
    assert "B's token 4242 not in A's top-k (gap >= 8.99 nats)" in p.rule


def test_different_lengths_without_eos_is_unexplained(tmp_path):
    p = one(tmp_path, Req("k", BASE), Req("k", BASE[:4]))
    assert (p.cls, p.position, p.len_a, p.len_b, p.token_a, p.token_b) == ("unexplained", 4, 6, 4, 9, None)
    assert "length mismatch: 6 vs 4 tokens, identical up to 4" in p.rule and p.vllm_close is True


def test_different_topk_widths(tmp_path):
    """A logs top-3, B top-8: overlap is over the narrower width; B's token at A's rank 2 still counts."""
    ra = Req("k", BASE, rows={2: [(7, -0.7), (99, -0.8), (50, -3.0)]})
    rb = Req(
        "k",
        with_flip(BASE, 2, 99),
        rows={2: [(99, -0.7), (7, -0.8), (51, -3.0)] + [(60 + i, -5.0 - i) for i in range(5)]},
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


def test_thresholds_are_validated_and_default_per_dtype():
    with pytest.raises(ConfigError, match="drift-nats"):
        Thresholds(tie_nats=0.5, drift_nats=0.1)
    with pytest.raises(ConfigError, match="tie-ulps"):
        Thresholds(tie_ulps=-1)
    with pytest.raises(ConfigError, match=r"--drift-nats \(0.00012207 for fp32\) must be >= --tie-nats"):
        Thresholds(tie_nats=0.2).for_dtype("fp32")  # a given tie above the fp32 default drift
    bf16, fp32 = Thresholds().for_dtype("bf16"), Thresholds().for_dtype("fp32")
    assert (bf16.tie_ulps, bf16.tie_nats, bf16.drift_nats) == (4, 0.5, 0.5)
    assert fp32.tie_ulps == 64 and fp32.drift_nats == 2**-13 and fp32.drift_mean_nats == 2**-16
    assert Thresholds(tie_ulps=2).for_dtype("fp32").tie_ulps == 2  # a given value applies to every dtype


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
