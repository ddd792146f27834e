"""Red team, the other way round: genuine benign divergences within the stated tolerances
(false-alarm probes), and the bugs just beyond each tolerance (controls at the edge).

Builders and the method: redteam_builders.py."""

from __future__ import annotations

import json
import math

import pytest
from support.redteam_builders import (
    BASE,
    EOS,
    GREEDY,
    Case,
    K,
    R,
    T,
    X,
    Y,
    Z,
    assert_sound,
    build,
    default_row,
    flipped,
    judge,
    marked,
    records_hold,
    softmax_row,
    tie_rows,
    tk,
)


def benign_cases() -> dict[str, Case]:
    """Genuine benign divergences within the stated tolerances (false-alarm probes)."""
    c: dict[str, Case] = {}
    for raw in (True, False):
        ra, rb = tie_rows(raw)
        name = "raw_logits" if raw else "logprobs_only"
        # The seed flip, in a dense row (runners-up at 17, 16.5, 16 instead of far below).
        dense_a = softmax_row([(X, 18.375), (Y, 18.375)], filler=(17.0, 16.5, 16.0))
        dense_b = softmax_row([(Y, 18.5), (X, 18.25)], filler=(17.0, 16.5, 16.0))
        if not raw:
            dense_a, dense_b = [x[:2] for x in dense_a], [x[:2] for x in dense_b]
        c[f"seed_dense_row_{name}"] = Case(
            R(BASE, rows={T: dense_a}), R(flipped(T, Y), rows={T: dense_b}), {"raw": raw}, expect="bf16_tie_flip"
        )
        # The seed flip at position 0 (nothing before it to measure drift on).
        c[f"seed_at_position_0_{name}"] = Case(
            R(flipped(0, X), rows={0: ra}), R(flipped(0, Y), rows={0: rb}), {"raw": raw}, expect="bf16_tie_flip"
        )
        # The seed flip on a run whose metadata names no dtype (assumed / inferred BF16).
        c[f"seed_unlabelled_run_{name}"] = Case(
            R(BASE, rows={T: ra}), R(flipped(T, Y), rows={T: rb}), {"raw": raw, "run": {}}, expect="bf16_tie_flip"
        )
        # A's exact tie listed in id order (Y first) while A chose X.
        c[f"seed_tie_listed_other_first_{name}"] = Case(
            R(BASE, rows={T: [ra[1], ra[0], *ra[2:]]}),
            R(flipped(T, Y), rows={T: rb}),
            {"raw": raw},
            expect="bf16_tie_flip",
        )

        # The seed flip after typical BF16 noise on the chosen logprobs before it (0.02 nats).
        # (The row moves with the column: a column that contradicts its own top-k row is a
        # finding of its own, see column_disagrees_with_topk_before_flip.)
        def nudged(tok, by):
            first, *rest = default_row(tok)
            return [(first[0], first[1] + by, first[2]), *rest]

        c[f"seed_after_small_drift_{name}"] = Case(
            R(BASE, rows={T: ra}),
            R(flipped(T, Y), rows={T: rb, 0: nudged(5, -0.02), 1: nudged(6, -0.02)}),
            {"raw": raw},
            expect="bf16_tie_flip",
        )
    ra, rb = tie_rows(raw=True)
    # The seed flip between a trace with raw logits (tracekit serve) and one with logprobs
    # only (vLLM): each judged with what it has.
    c["seed_raw_on_a_only"] = Case(
        R(BASE, rows={T: ra}),
        R(flipped(T, Y), rows={T: [x[:2] for x in rb]}),
        {"raw": True},
        opts_b={"raw": False},
        expect="bf16_tie_flip",
    )
    # vLLM --logprobs-mode raw_logits: logits only, NaN logprobs (as capture stores them).
    nan_lp = {t: math.nan for t in range(6)}
    c["seed_logits_mode"] = Case(
        R(BASE, rows={T: [(x[0], math.nan, x[2]) for x in ra]}, lp=nan_lp),
        R(flipped(T, Y), rows={T: [(x[0], math.nan, x[2]) for x in rb]}, lp=nan_lp),
        {"raw": True},
        expect="bf16_tie_flip",
    )
    # The same 1-step-each flip at |logit| in [32, 64) (BF16 spacing 0.25): 36/36 -> 36.25/35.75,
    # 2 steps = 0.5 nats, logprobs only (top logits of 15-40 are common).
    big_a = [x[:2] for x in softmax_row([(X, 36.0), (Y, 36.0)], filler=(30.0, 29.0, 28.0))]
    big_b = [x[:2] for x in softmax_row([(Y, 36.25), (X, 35.75)], filler=(30.0, 29.0, 28.0))]
    c["one_step_flip_at_36_logprobs_only"] = Case(
        R(BASE, rows={T: big_a}), R(flipped(T, Y), rows={T: big_b}), expect="bf16_tie_flip"
    )
    # A genuine prefix-cache boundary change (0 vs 3 of a 4-token prompt), 5-step gap.
    gap5_a = softmax_row([(X, 18.625), (Y, 18.0)])
    gap5_b = softmax_row([(Y, 18.625), (X, 18.0)])
    c["boundary_change_5_steps"] = Case(
        R(BASE, rows={T: gap5_a}, cached=0),
        R(flipped(T, Y), rows={T: gap5_b}, cached=3),
        {"raw": True},
        expect="cache_boundary",
    )
    # EOS ignored on both sides (the fixtures' mode), identical up to and including the EOS.
    ign = {**GREEDY, "ignore_eos": True}
    c["post_eos_ignored_eos"] = Case(
        R([5, EOS, 7, 8, 9, 10], params=ign), R([5, EOS, 7, 4242, 9, 10], params=ign), expect="post_eos"
    )
    # vLLM raw_logits mode, same tokens, BF16 batching noise: each chosen logit at |x| ~ 36
    # moves by one BF16 step (0.25) at every other position (measured noise: <= 2 steps).
    n = 40
    toks = [5 + (i % 6) for i in range(n)]

    def lrow(tok, lg):
        return [(tok, math.nan, lg)] + [(1000 + i, math.nan, 20.0 - i) for i in range(K - 1)]

    nan_n = {t: math.nan for t in range(n)}
    c["logits_mode_one_step_noise_bf16"] = Case(
        R(toks, rows={t: lrow(tok, 36.0) for t, tok in enumerate(toks)}, lp=nan_n),
        R(toks, rows={t: lrow(tok, 36.0 + (0.25 if t % 2 else 0.0)) for t, tok in enumerate(toks)}, lp=nan_n),
        {"raw": True},
        expect="identical",
    )
    # The same on an FP32 run: every chosen logit at 36 moves 8 FP32 steps (8 * 2^-18),
    # half the measured FP32 noise (<= 16 steps).
    step32 = 2.0**-18
    c["logits_mode_eight_step_noise_fp32"] = Case(
        R(toks, rows={t: lrow(tok, 36.0) for t, tok in enumerate(toks)}, lp=nan_n),
        R(toks, rows={t: lrow(tok, 36.0 + 8 * step32) for t, tok in enumerate(toks)}, lp=nan_n),
        {"raw": True, "run": {"dtype": "fp32"}},
        expect="identical",
    )
    # Logits near zero (the floor case: a logit is a sum of terms of the row's
    # magnitude): A's X / Y at 2^-10 / 0 (1/8 of one BF16 step at the floor |x| = 1), their
    # logprobs 0.01 nats apart (1.3 steps at the floor): logits and logprobs agree within the
    # 4-step tie tolerance *at the floor*; the agreement check is not floored.
    z = 2.0**-10
    c["near_zero_logits_agree_at_the_floor"] = Case(
        R(BASE, rows={T: [(X, -0.69, z), (Y, -0.70, 0.0), (1000, -6.0, -5.0)]}),
        R(flipped(T, Y), rows={T: [(Y, -0.69, z), (X, -0.70, 0.0), (1000, -6.0, -5.0)]}),
        {"raw": True},
        expect="bf16_tie_flip",
    )
    # temperature > 0 with top_k 1 is greedy decoding (vLLM, SGLang, llama.cpp).
    topk1 = {"temperature": 0.7, "top_k": 1, "max_tokens": 6}
    tie_a, tie_b = tie_rows(raw=False)
    c["top_k_1_is_greedy"] = Case(
        R(BASE, rows={T: tie_a}, params=topk1), R(flipped(T, Y), rows={T: tie_b}, params=topk1), expect="bf16_tie_flip"
    )
    return c


def control_cases() -> dict[str, Case]:
    """Bugs next to the tolerance edges and near the holes above that are caught today:
    they guard the edges (inclusive tolerances, one step beyond is a bug)."""
    c: dict[str, Case] = {}
    # Both candidates moved 17 steps (tolerance 16) with the gap still a tie.
    mv_a = softmax_row([(X, 18.375), (Y, 18.375)])
    mv_b = softmax_row([(Y, 18.375 + 17 * 0.125), (X, 18.375 + 17 * 0.125 - 0.25)])
    c["moved_17_steps"] = Case(
        R(BASE, rows={T: mv_a}), R(flipped(T, Y), rows={T: mv_b}), {"raw": True}, words=("(> 16 ulp, bf16)",)
    )
    # A 5-step gap with equal boundaries (or one unknown, -1) is not a tie.
    gap5_a = softmax_row([(X, 18.625), (Y, 18.0)])
    gap5_b = softmax_row([(Y, 18.625), (X, 18.0)])
    c["gap_5_steps_boundary_unknown"] = Case(
        R(BASE, rows={T: gap5_a}, cached=-1),
        R(flipped(T, Y), rows={T: gap5_b}, cached=3),
        {"raw": True},
        words=("beyond the tie tolerance 4 ulp (bf16), boundaries unknown (? vs 3)",),
    )
    # A boundary change does not excuse a 17-step gap.
    gap17_a = softmax_row([(X, 18.0 + 17 * 0.125), (Y, 18.0)])
    gap17_b = softmax_row([(Y, 18.0 + 17 * 0.125), (X, 18.0)])
    c["boundary_change_17_steps"] = Case(
        R(BASE, rows={T: gap17_a}, cached=0),
        R(flipped(T, Y), rows={T: gap17_b}, cached=3),
        {"raw": True},
        words=("beyond the drift tolerance 16 ulp",),
    )
    # Logprobs only: B's token 0.51 nats below A's in B's own row (tolerance 0.5).
    tie_a = [(X, -0.69), (Y, -0.70), (1000, -6.0)]
    c["gap_0_51_nats"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: [(Y, -0.44), (X, -0.95), (1000, -6.0)]}),
        words=("0.51 nats",),
    )
    # Logprobs only: a tie whose candidates both fell 0.51 nats from A to B (tolerance 0.5).
    c["moved_0_51_nats"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: [(Y, -1.20), (X, -1.20), (1000, -6.0)]}),
        words=("token 7 moved -0.51 nats from A to B (> 0.5 nats, bf16)",),
    )
    # Same prompt_hash, different prompt ids: ids are authoritative.
    c["prompt_ids_differ_hash_equal"] = Case(
        R(BASE, phash="same"),
        R(BASE, prompt=(11, 12, 13, 15), phash="same"),
        expect="incomparable",
        words=("token ids differ at prompt position 3",),
    )
    # A mean drift of 0.09 nats over 19 positions (bound 0.0625 + 0.4375 / 19 = 0.0855).
    n = 20
    toks = [5 + (i % 6) for i in range(n)]
    base_lp = default_row(5)[0][1]
    c["mean_drift_just_beyond"] = Case(
        R(toks, rows={n - 1: [(toks[-1], -0.69), (Y, -0.70)]}),
        R(
            flipped(n - 1, Y, toks),
            lp={i: base_lp - 0.09 for i in range(n - 1)},
            rows={n - 1: [(Y, -0.69), (toks[-1], -0.70)]},
        ),
        words=("mean drift 0.09 nats over 19 positions before the flip > 0.0855",),
    )
    # B's chosen token absent from its own top-k.
    c["chosen_absent_from_own_topk"] = Case(
        R(BASE, rows={T: tie_rows(False)[0]}),
        R(flipped(T, Y), rows={T: [(X, -0.7), (Z, -0.7), (1000, -5.0)]}, lp={T: -0.7}),
        words=("B chose token 99, not in its own top-k",),
    )
    # B's request sampled (run sampling block, no body).
    c["sampled_via_run_metadata"] = Case(
        R(BASE, rows={T: tie_rows(False)[0]}),
        R(flipped(T, Y), rows={T: tie_rows(False)[1]}),
        opts_b={"run": {"dtype": "bf16", "sampling": {"temperature": 0.8}}},
        expect="incomparable",
        words=("B's request has temperature 0.8",),
    )
    # A NaN in a candidate's logprob at the flip: no tie can be proven.
    c["nan_candidate_at_flip"] = Case(
        R(BASE, rows={T: [(X, -0.69), (Y, math.nan), (1000, -6.0)]}),
        R(flipped(T, Y), rows={T: [(Y, -0.69), (X, -0.70), (1000, -6.0)]}),
        words=("|gap| A ? nats",),
    )
    # One side empty (0 tokens), the other not.
    c["one_side_empty"] = Case(R(BASE), R([], finish="stop"), words=("length mismatch: 6 vs 0 tokens",))
    # Logits mode: a 3-logit drift before the flip (measured on the chosen raw logits).
    return c


BENIGN = benign_cases()
CONTROLS = control_cases()

# What the classifier called a bug before its fix: the wrong verdict and why.
FIXED_FALSE_ALARMS = {
    "logits_mode_one_step_noise_bf16": "unexplained (mean drift 0.125 > 0.0734 'nats'); in logits mode the "
    "drift on raw logits is held to the logprob tolerances in nats, not to grid steps",
    "logits_mode_eight_step_noise_fp32": "unexplained (mean drift 3.05e-05 > 1.79e-05); as above, on FP32",
    "near_zero_logits_agree_at_the_floor": "unexplained (logits and logprobs 'disagree' by 0.009 > 3.05e-05); "
    "the agreement tolerance is taken at the raw scale, not floored like the steps",
    "top_k_1_is_greedy": "incomparable ('sampled'); top_k 1 makes temperature irrelevant",
}
FALSE_ALARMS: dict[str, str] = {}  # what it calls a bug today


def test_records_name_cases_of_this_file():
    records_hold(BENIGN, FIXED_FALSE_ALARMS, FALSE_ALARMS)


@pytest.mark.parametrize("name", list(CONTROLS))
def test_bug_at_the_edge_is_caught(tmp_path, name):
    c = CONTROLS[name]
    r, p = judge(tmp_path, c)
    assert_sound(r, p, c)


@pytest.mark.parametrize("name", marked(BENIGN, FALSE_ALARMS, "false alarm"))
def test_benign_case_is_benign(tmp_path, name):
    c = BENIGN[name]
    r, p = judge(tmp_path, c)
    assert (p.cls, r.ok) == (c.expect, True), p.rule


@pytest.mark.parametrize("name", ["seed_dense_row_logprobs_only", "seed_logits_mode"])
def test_seed_flip_exits_0_via_the_cli(tmp_path, name):
    a, b = build(tmp_path, BENIGN[name])
    p = tk("diff", a, b, "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
    assert json.loads(p.stdout)["pairs"][0]["class"] == "bf16_tie_flip"
