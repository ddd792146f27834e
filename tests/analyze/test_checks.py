"""Each check of the taxonomy's table (analyze/checks.py) on constructed facts: pair 0 passes
it, pair 1 fails it, and the failure's reason carries the numbers that decided it.

The facts start as two sound BF16 tie flips (A chose 7, B chose 9, 1 step apart in each, both
moved 1 step, drift 0.01 nats over 5 positions); each test breaks one thing in pair 1.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import pytest

from tracekit.analyze import checks
from tracekit.analyze.classify import DEFAULTS
from tracekit.analyze.eos_policy import Skipped
from tracekit.analyze.evidence import DUP_ID, POS_INF, SUM_OVER_ONE
from tracekit.analyze.facts import FLIP, LENGTH, SAME, Facts, SideEvidence, empty_rows
from tracekit.analyze.positions import Drift
from tracekit.analyze.rules import rule_text

P = 2


def _drift(mx=0.01, mean=0.005, n=5) -> Drift:
    none = np.full(P, -1)
    z = np.zeros(P, np.int64)
    return Drift(
        np.full(P, mx), np.full(P, mean), np.full(P, n), z.copy(), none.copy(), np.full(P, np.nan),
        np.full(P, np.nan), z.copy(), none.copy(), np.full((P, 3), np.nan), np.zeros(P, bool), np.full(P, np.nan),
    )  # fmt: skip


def _side(token: int, other: int) -> SideEvidence:
    row = empty_rows(P)
    row.update(
        gap=np.full(P, 0.125), gap_ulp=np.full(P, 1.0), below=np.zeros(P), below_ulp=np.zeros(P),
        top1=np.full(P, token), lp_top=np.full(P, -0.6), lg_top=np.full(P, 20.0), agree=np.zeros(P),
        agree_tol=np.full(P, 0.5), move=np.full(P, 0.1), move_ulp=np.full(P, 1.0), lse=np.zeros(P),
        lse_tol=np.full(P, 2.0), own_in_topk=np.ones(P, bool), other_in_topk=np.ones(P, bool),
        prob_sum=np.full(P, 0.9), col_lp=np.full(P, -0.6), topk_lp=np.full(P, -0.6), max_lp=np.full(P, -0.6),
        lg_mine=np.full(P, 20.0), lg_other=np.full(P, 19.875),
    )  # fmt: skip
    return SideEvidence(
        token=np.full(P, token), n=np.full(P, 12), trunc=np.full(P, "", object), boundary=np.full(P, 0),
        boundary_valid=np.ones(P, bool), prompt_len=np.full(P, 16), dtype=np.full(P, "bf16", object), **row,
    )  # fmt: skip


def facts(**over) -> Facts:
    tol = {k: np.full(P, float(v)) for k, v in asdict(DEFAULTS["bf16"]).items()}
    tol.update(tie_move_ulps=np.zeros(P), tie_move_nats=np.zeros(P))  # uncalibrated: no gap-move tie
    f = Facts(
        key=np.array(["k0", "k1"], object), incomparable=np.full(P, "", object), kind=np.full(P, FLIP, np.int8),
        position=np.full(P, 5), compared=np.full(P, 12), a=_side(7, 9), b=_side(9, 7), topk_overlap=np.ones(P),
        dtype=np.full(P, "bf16", object), tol=tol, main=_drift(), sound=_drift(np.nan, np.nan, 0),
        on_logits=np.zeros(P, bool), drift_tol=tol["drift_nats"], drift_mean_tol=tol["drift_mean_nats"],
        eos_pos=np.full(P, -1), eos_id=np.full(P, -1), eos_known=np.ones(P, bool), eos_refuted=np.full(P, "", object),
        eos_skip=Skipped(*(np.full(P, "", object) for _ in range(3))), boundary_differs=np.zeros(P, bool),
        vllm_close=np.ones(P, np.int8), note=np.full(P, "", object),
    )  # fmt: skip
    for k, v in over.items():
        setattr(f, k, v)
    return f


def _check(name: str) -> checks.Check:
    return next(c for c in checks.CHECKS if c.name == name)


def _fails(f: Facts, name: str) -> str:
    """The check passes pair 0 and fails pair 1; pair 1's text is exactly its reason (quoted)."""
    ok = _check(name).mask(f)
    assert ok.tolist() == [True, False], (name, ok)
    j = checks.judge(f)
    assert j.cls[0] != "unexplained" and j.cls[1] == "unexplained", j.cls
    got = checks.failures(f, j, 1)
    assert got == _check(name).reason(f, 1) and len(got) == 1, got
    assert rule_text(f, j, 1) == got[0]
    return got[0]


def _set(arr, v):
    arr = arr.copy()
    arr[1] = v
    return arr


def _side_with(f: Facts, x: str, **fields) -> Facts:
    s = getattr(f, x)
    setattr(f, x, replace(s, **{k: _set(getattr(s, k), v) for k, v in fields.items()}))
    return f


def test_every_check_has_a_test_here():
    here = open(__file__).read()
    for c in checks.CHECKS:
        stem = c.name[:-2] if c.name[-2:] in ("_a", "_b") else c.name
        assert f'"{stem}' in here, c.name


def test_the_clean_facts_are_ties():
    f = facts()
    j = checks.judge(f)
    assert j.cls.tolist() == ["bf16_tie_flip"] * 2
    # no EOS, no boundary change: the other claims' checks fail, the tie's all pass
    assert {n for n, v in j.ok.items() if not v.all()} == {"eos_before", "boundary_gap"}
    assert rule_text(f, j, 0) == (
        "tie on the bf16 grid: |gap| A 1 ulp <= 4 ulp, B 1 ulp <= 4 ulp; each chose its own top-1; moved A->B: "
        "token 7 +1 ulp, token 9 +1 ulp <= 16 ulp; drift max 0.01 / mean 0.005 nats over 5 positions <= 0.5 / 0.15"
    )


def test_drift():
    f = facts(main=replace(_drift(), max=np.array([0.01, 0.75])))
    assert _fails(f, "drift") == "logprobs drift 0.75 nats before the flip > 0.5 (bf16)"


def test_drift_mean_and_same_ids():
    d = replace(_drift(), mean=np.array([0.005, 0.3]), max=np.array([0.01, 0.45]))
    f = facts(main=d, kind=np.full(P, SAME, np.int8), position=np.full(P, -1))
    assert _fails(f, "drift") == (
        "same 12 token ids, but mean drift 0.3 nats over 5 positions > 0.15 (bf16: 0.0625 + (0.5 - 0.0625) / 5)"
    )


def test_sound_drift():
    eos = dict(eos_pos=np.full(P, 3), eos_id=np.full(P, 2), kind=np.full(P, LENGTH, np.int8))
    f = facts(**eos, sound=replace(_drift(), max=np.array([0.01, 0.9])))
    assert _fails(f, "sound_drift") == "logprobs drift 0.9 nats up to A's EOS > 0.5 (bf16)"
    assert rule_text(f, checks.judge(f), 0).startswith("A emitted EOS (id 2) at 3 before the first difference at 5")


def test_eos_not_refuted():
    eos = dict(eos_pos=np.full(P, 3), eos_id=np.full(P, 2), kind=np.full(P, LENGTH, np.int8))
    said = "B went on past the EOS at 3 although its request did not ignore EOS"
    f = facts(**eos, sound=_drift(), eos_refuted=np.array(["", said], object))
    assert _fails(f, "eos_not_refuted") == said


def test_eos_before():
    f = facts(kind=np.full(P, LENGTH, np.int8), eos_pos=np.array([3, -1]), sound=_drift())
    f.b = replace(f.b, n=np.array([12, 20]))
    assert _fails(f, "eos_before") == "length mismatch: 12 vs 20 tokens, identical up to 12, no EOS before"


@pytest.mark.parametrize("x", ["a", "b"])
def test_complete(x):
    f = _side_with(facts(), x, trunc="ended with finish_reason length before max_tokens 32 (12 tokens)")
    assert _fails(f, f"complete_{x}") == (
        f"{x.upper()}'s stream ended with finish_reason length before max_tokens 32 (12 tokens)"
    )


@pytest.mark.parametrize("x", ["a", "b"])
def test_boundary_valid(x):
    f = facts(boundary_differs=np.zeros(P, bool))
    # beyond the tie in both: only a cache boundary could explain them
    f.a = replace(f.a, boundary=np.full(P, 4), gap_ulp=np.full(P, 6.0))
    f.b = replace(f.b, boundary=np.full(P, 8), gap_ulp=np.full(P, 6.0))
    f.boundary_differs = np.array([True, False])  # pair 1: x's boundary is no boundary
    f = _side_with(f, x, boundary_valid=False, boundary=40 if x == "a" else 44)
    ok = _check(f"boundary_valid_{x}").mask(f)
    assert ok.tolist() == [True, False]
    j = checks.judge(f)
    assert j.cls.tolist() == ["cache_boundary", "unexplained"]
    text = rule_text(f, j, 1)
    b = 40 if x == "a" else 44
    assert f"{x.upper()}'s cached_tokens {b} exceeds its prompt (16 tokens): no boundary" in text
    assert "|gap| A 6 ulp, B 6 ulp beyond the tie tolerance 4 ulp (bf16), boundaries not valid" in text


@pytest.mark.parametrize("x", ["a", "b"])
def test_row_sane(x):
    f = _side_with(facts(), x, row_bad=DUP_ID | SUM_OVER_ONE, dup_id=9.0, dup_lp1=-0.5, dup_lp2=-1.25, prob_sum=1.7)
    assert _fails(f, f"row_sane_{x}") == (
        f"{x.upper()}'s top-k row at 5 lists id 9 twice (-0.5, -1.25), has probabilities summing to 1.7 (> 1)"
    )


@pytest.mark.parametrize("x", ["a", "b"])
def test_other_in_topk(x):
    f = _side_with(facts(), x, other_in_topk=False, gap=3.5, gap_ulp=np.nan)
    mine, other = ("A", "B") if x == "a" else ("B", "A")
    tok = 9 if x == "a" else 7
    ok = _check(f"other_in_topk_{x}").mask(f)
    assert ok.tolist() == [True, False]
    j = checks.judge(f)
    assert j.cls[1] == "unexplained"
    assert checks.failures(f, j, 1) == [f"{other}'s token {tok} not in {mine}'s top-k (gap >= 3.5 nats)"]


@pytest.mark.parametrize("x", ["a", "b"])
def test_greedy(x):
    f = _side_with(facts(), x, below=0.4, below_ulp=3.0, top1=11)
    tok = 7 if x == "a" else 9
    assert _fails(f, f"greedy_{x}") == (
        f"{x.upper()} chose token {tok}, 3 ulp below its own top-1 11 (greedy: its own top-1, ties allowed)"
    )


def test_greedy_not_in_own_topk_and_row_says_inf():
    f = _side_with(facts(), "b", own_in_topk=False, top1=11)
    assert _fails(f, "greedy_b") == "B chose token 9, not in its own top-k (top-1 11)"
    f = _side_with(facts(), "a", below=0.4, below_ulp=3.0, row_bad=POS_INF)
    j = checks.judge(f)
    assert not j.ok["greedy_a"][1] and _check("greedy_a").reason(f, 1) == []  # the row check says it
    assert checks.failures(f, j, 1) == ["A's top-k row at 5 holds +inf"]


@pytest.mark.parametrize("x", ["a", "b"])
def test_agree(x):
    f = _side_with(facts(), x, agree=0.75, agree_tol=0.5)
    assert _fails(f, f"agree_{x}") == (
        f"{x.upper()}'s logits and logprobs disagree: logit gap 0.875, logprob gap 0.125 nats (differ by 0.75 > 0.5)"
    )


@pytest.mark.parametrize("x", ["a", "b"])
def test_moved(x):
    f = _side_with(facts(), x, move_ulp=17.0, move=2.0)
    tok = 7 if x == "a" else 9
    assert _fails(f, f"moved_{x}") == f"token {tok} moved +17 ulp from A to B (> 16 ulp, bf16)"


def test_moved_logprob_but_not_logit():
    f = _side_with(facts(), "a", move=1.5, lse=1.4, lse_tol=1.0)
    assert _fails(f, "moved_a") == (
        "token 7's logprob moved +1.5 nats from A to B while its logit moved +1 ulp "
        "(the normaliser shifted 1.4 nats > 1 = 16 ulp here, bf16)"
    )


def test_moved_in_nats_without_logits():
    f = _side_with(facts(), "b", move_ulp=np.nan, move=-0.625)
    assert _fails(f, "moved_b") == "token 9 moved -0.625 nats from A to B (> 0.5 nats, bf16)"


def test_tie_gap():
    f = _side_with(_side_with(facts(), "a", gap_ulp=5.0), "b", gap_ulp=2.0)
    assert _fails(f, "tie_gap") == (
        "|gap| A 5 ulp, B 2 ulp beyond the tie tolerance 4 ulp (bf16), boundaries equal (0 vs 0)"
    )


def test_tie_gap_within_the_healthy_gap_move():
    """The H200 Qwen3-4B pair: A 1 ulp, B 6 ulp. Beyond the 4-ulp tie uncalibrated; a tie where the
    calibration measured a healthy top-2 gap move of 7 ulp (the sum's bound); beyond a 6-ulp move."""
    f = _side_with(facts(), "b", gap_ulp=6.0)
    assert (
        _fails(f, "tie_gap")
        == "|gap| A 1 ulp, B 6 ulp beyond the tie tolerance 4 ulp (bf16), boundaries equal (0 vs 0)"
    )
    f.tol = {**f.tol, "tie_move_ulps": np.full(P, 7.0)}
    assert _check("tie_gap").mask(f).tolist() == [True, True]
    assert checks.judge(f).cls.tolist() == ["bf16_tie_flip"] * 2
    f.tol = {**f.tol, "tie_move_ulps": np.full(P, 6.0)}
    assert _fails(f, "tie_gap") == (
        "|gap| A 1 ulp, B 6 ulp beyond the tie tolerance 4 ulp (bf16), and their sum 7 ulp beyond this "
        "engine's healthy top-2 gap move 6 ulp, boundaries equal (0 vs 0)"
    )


def test_boundary_gap():
    f = facts()
    f.a = replace(f.a, boundary=np.full(P, 0), gap_ulp=np.array([6.0, 17.0]))
    f.b = replace(f.b, boundary=np.full(P, 8), gap_ulp=np.full(P, 6.0))
    f.boundary_differs = np.ones(P, bool)
    ok = _check("boundary_gap").mask(f)
    assert ok.tolist() == [True, False]
    j = checks.judge(f)
    assert j.cls.tolist() == ["cache_boundary", "unexplained"]
    assert not j.ok["tie_gap"].any()  # beyond the tie in both: the tie check says nothing here
    assert checks.failures(f, j, 1) == [
        "|gap| A 17 ulp, B 6 ulp beyond the drift tolerance 16 ulp (bf16; boundaries 0 vs 8)"
    ]
    assert rule_text(f, j, 0).startswith("boundaries 0 vs 8, a numeric-size gap on the bf16 grid: |gap| A 6 ulp")


def test_tie_at_one_boundary_in_nats():
    """Issue 24, item 10: without raw logits (llama.cpp) the tie and drift tolerances are one
    number, so a flip whose reused prefixes differ (34 vs 123) was always a tie and its boundary
    never said. Pair 0 (logits) stays a tie; pair 1 (nats only) is cache_boundary, its rule in nats."""
    f = facts()
    f.a = replace(f.a, boundary=np.full(P, 34), gap_ulp=np.array([1.0, np.nan]), gap=np.full(P, 0.004))
    f.b = replace(f.b, boundary=np.full(P, 123), gap_ulp=np.array([1.0, np.nan]), gap=np.full(P, 0.002))
    f.a = replace(f.a, move_ulp=np.array([1.0, np.nan]))
    f.b = replace(f.b, move_ulp=np.array([1.0, np.nan]))
    f.boundary_differs = np.ones(P, bool)
    assert _check("tie_at_one_boundary").mask(f).tolist() == [True, False]
    j = checks.judge(f)
    assert j.cls.tolist() == ["bf16_tie_flip", "cache_boundary"]
    assert checks.failures(f, j, 1) == []  # never quoted: the boundary claim holds there
    assert rule_text(f, j, 1).startswith(
        "boundaries 34 vs 123, a numeric-size gap in nats (bf16; no raw logits): |gap| A 0.004 nats <= 0.5 nats"
    )
    # boundaries equal, nats only: a tie, said in nats
    f.boundary_differs = np.zeros(P, bool)
    j = checks.judge(f)
    assert j.cls.tolist() == ["bf16_tie_flip"] * 2
    assert rule_text(f, j, 1).startswith("tie in nats (bf16; no raw logits): |gap| A 0.004 nats <= 0.5 nats")


def test_reasons_follow_the_table_order_and_the_note_comes_last():
    f = _side_with(_side_with(facts(), "b", agree=0.75, agree_tol=0.5), "a", row_bad=POS_INF)
    f.note = np.array(["", "B's logits at the difference are not on the bf16 grid: judged on fp32"], object)
    j = checks.judge(f)
    assert rule_text(f, j, 1) == (
        "A's top-k row at 5 holds +inf; B's logits and logprobs disagree: logit gap 0.875, logprob gap 0.125 "
        "nats (differ by 0.75 > 0.5); note: B's logits at the difference are not on the bf16 grid: judged on fp32"
    )
