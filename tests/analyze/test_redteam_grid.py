"""Red team, dtype and grid: dtype labels the logits refute, grids inferred or assumed, and drift
in raw-logits mode.

Builders and the method: redteam_builders.py."""

from __future__ import annotations

import math

import pytest
from support.redteam_builders import (
    BASE,
    GREEDY,
    NAN6,
    Case,
    K,
    R,
    T,
    X,
    Y,
    cli_exits_1,
    family_tests,
    flipped,
    marked,
    softmax_row,
    tie_rows,
)


def cases() -> dict[str, Case]:
    """Bugs: dtype and grid."""
    c: dict[str, Case] = {}
    raw_a, raw_b = tie_rows(raw=True)

    # -- dtype / grid --------------------------------------------------------------------------
    # An FP32 run (capture label fp32, logits 18.3 / 18.0 off the BF16 grid) whose engine
    # self-report says bf16: the self-report wins, the conflict is a note, and a 0.3-nat FP32
    # flip (157,286 FP32 steps) is a "tie" of 2.4 BF16 steps.
    fp32_a = softmax_row([(X, 18.3), (Y, 18.0)])
    fp32_b = softmax_row([(Y, 18.3), (X, 18.0)])
    conflict = {"dtype": "fp32", "engine": {"v1_models": {"meta": {"dtype": "bf16"}}}}
    c["dtype_conflict_selfreport_bf16"] = Case(
        R(BASE, rows={T: fp32_a}),
        R(flipped(T, Y), rows={T: fp32_b}),
        opts={"raw": True, "run": conflict},
        words=("fp32",),
    )
    # An HTTP request row's own `dtype` field (meant for teacher-forced rows) overrides the
    # run's fp32, silently (no note).
    c["row_dtype_overrides_run"] = Case(
        R(BASE, rows={T: fp32_a}, dtype="bf16"),
        R(flipped(T, Y), rows={T: fp32_b}, dtype="bf16"),
        opts={"raw": True, "run": {"dtype": "fp32"}},
        words=("fp32",),
    )
    # Labelled bf16, but the logits 18.3 / 18.0 are not BF16 numbers: the label is false.
    # (tests/analyze/test_soundness.py::test_fp32_flip_is_benign_only_on_the_bf16_grid
    # asserts today's tie for exactly these numbers.)
    c["logits_off_the_labelled_grid"] = Case(
        R(BASE, rows={T: fp32_a}), R(flipped(T, Y), rows={T: fp32_b}), opts={"raw": True}
    )
    # No dtype in the metadata: the grid is inferred from the first 256 token rows, all on the
    # BF16 grid (integer logits of an earlier request); the divergent row's 18.3 / 18.0 is not.
    warm = R([5] * 300, key="warm")
    c["inferred_grid_sample_blindspot"] = Case(
        [warm, R(BASE, rows={T: fp32_a})],
        [warm, R(flipped(T, Y), rows={T: fp32_b})],
        opts={"raw": True, "run": {}},
        words=("fp32",),
    )
    # A is labelled fp32; B names no dtype and has no logits: B is *assumed* bf16 and the pair
    # judged on the coarser, assumed grid, so a 0.3-nat flip is a tie (<= 0.5 nats).
    c["assumed_grid_coarser_than_known"] = Case(
        R(BASE, rows={T: [x[:2] for x in fp32_a]}),
        R(flipped(T, Y), rows={T: [x[:2] for x in fp32_b]}),
        opts={"run": {"dtype": "fp32"}},
        opts_b={"run": {}},
        words=("fp32",),
    )

    # -- raw-logits mode drift ------------------------------------------------------------
    # vLLM --logprobs-mode raw_logits (logits stored, logprobs NaN): before a seed-sized tie
    # flip B's chosen logits drift by 3.0 (24 BF16 steps) at positions 0 and 1.
    def lrow(tok, lg):
        return [(tok, math.nan, lg)] + [(1000 + i, math.nan, 8.0 - i) for i in range(K - 1)]

    c["logits_mode_drift"] = Case(
        R(BASE, rows={0: lrow(5, 20.0), 1: lrow(6, 20.0), T: [(x[0], math.nan, x[2]) for x in raw_a]}, lp=NAN6),
        R(
            flipped(T, Y),
            rows={0: lrow(5, 23.0), 1: lrow(6, 17.0), T: [(x[0], math.nan, x[2]) for x in raw_b]},
            lp=NAN6,
        ),
        opts={"raw": True},
        nums=(3.0,),
    )
    # The same drift in logits mode, with one ordinary request ("warm", logprobs stored) in
    # both files: the switch to drift on raw logits is made per file, so for "k" (NaN
    # logprobs on both sides) drift is skipped and the flip is a tie.
    warm = R([5, 6], key="warm", params=GREEDY)
    c["logits_mode_drift_hidden_by_one_logprob_request"] = Case(
        [warm, c["logits_mode_drift"].a],
        [warm, c["logits_mode_drift"].b],
        opts={"raw": True},
        nums=(3.0,),
    )
    return c


CASES = cases()

# What fooled the classifier before its fix: the wrong verdict it gave and the check that was missing.
FIXED = {
    "dtype_conflict_selfreport_bf16": "bf16_tie_flip (a note only); a dtype conflict is resolved to the "
    "coarser-named grid, not checked against the logits",
    "row_dtype_overrides_run": "bf16_tie_flip, no note; an HTTP row's dtype field overrides the run's fp32",
    "logits_off_the_labelled_grid": "bf16_tie_flip; logits off the labelled grid do not refute the label",
    "inferred_grid_sample_blindspot": "bf16_tie_flip; the grid is inferred from the first 256 rows only",
    "assumed_grid_coarser_than_known": "bf16_tie_flip; an unlabelled side is assumed bf16 and the pair judged "
    "on the coarser grid although the other side is fp32",
    "logits_mode_drift_hidden_by_one_logprob_request": "bf16_tie_flip ('no logprob to compare'); drift "
    "switches to raw logits per file, not per request",
}
FOOLED: dict[str, str] = {}  # what fools it today


test_records_name_cases_of_this_family, test_bug_is_not_benign = family_tests(CASES, FIXED, FOOLED)


@pytest.mark.parametrize("name", marked(["logits_mode_drift"], FOOLED, "fooled"))
def test_bug_exits_1_via_the_cli(tmp_path, name):
    cli_exits_1(tmp_path, CASES[name])
