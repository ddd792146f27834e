"""Red team, top-k rows and greedy: the chosen logprob column against the top-k rows,
logits against logprobs, non-finite, impossible or malformed top-k values, and a side that did not choose its own top-1.

Builders and the method: redteam_builders.py."""

from __future__ import annotations

import math

import pytest
from support.redteam_builders import (
    BASE,
    NAN6,
    Case,
    R,
    T,
    X,
    Y,
    Z,
    cli_exits_1,
    default_row,
    family_tests,
    flipped,
    marked,
    shifted,
    softmax_row,
    tie_rows,
)


def cases() -> dict[str, Case]:
    """Bugs: top-k rows and greedy."""
    c: dict[str, Case] = {}
    tie_a, tie_b = tie_rows(raw=False)
    raw_a, raw_b = tie_rows(raw=True)
    # B's row at position 3 (logprobs only): its chosen token 8 still top-1, at -5.0 nats
    # (A: -0.0002), the rest of the mass outside the top-k.
    drop5 = [(8, -5.0), (1000, -9.0), (1001, -10.0)]

    # -- the chosen logprob column vs the top-k rows ----------------------------------
    # B's stored chosen logprob (-11.75: 11 nats below the tie) contradicts its own top-k
    # entry for the same token (-0.58): the tie is read from the row, the column is never
    # compared with it.
    c["chosen_lp_contradicts_topk"] = Case(
        R(BASE, rows={T: tie_a}), R(flipped(T, Y), rows={T: tie_b}, lp={T: -11.75}), nums=(11.75,)
    )
    # B stored every chosen logprob as NaN; its top-k rows hold them, and at position 3 the
    # chosen token fell from -0.0002 to -5.0: "drift not verified", identical, exit 0.
    c["nan_column_hides_topk_drift"] = Case(R(BASE), R(BASE, rows={3: drop5}, lp=NAN6), nums=(5.0,))
    # Both sides stored NaN as the chosen logprob at position 3 ("not recorded": skipped), but
    # the top-k rows hold it: -0.0002 in A, -5.0 in B.
    c["nan_both_sides_hides_topk_drift"] = Case(
        R(BASE, lp={3: math.nan}), R(BASE, rows={3: drop5}, lp={3: math.nan}), nums=(5.0,)
    )
    # B's chosen logprob column holds A's value (-0.0002) at position 3, its own top-k row
    # -5.0 for the same token: identical, exit 0. (The check missing in
    # chosen_lp_contradicts_topk, before the flip / in an identical pair.)
    c["column_disagrees_with_topk_before_flip"] = Case(
        R(BASE), R(BASE, rows={3: drop5}, lp={3: default_row(8)[0][1]}), nums=(5.0,)
    )
    # B's chosen logprob is -inf at every position (probability 0 for each token it chose):
    # taken for "stored no logprobs".
    c["neginf_chosen_everywhere"] = Case(R(BASE), R(BASE, lp={t: -math.inf for t in range(6)}), words=("inf",))

    # -- logits vs logprobs -------------------------------------------------------------
    # The seed flip's logits, but B's logprobs of both candidates fell 5 nats (mass leaked to
    # ids outside the top-k, e.g. padded-vocab logits left unmasked): with logits on both
    # sides only the logits' movement (1 step) is checked.
    moved = shifted(raw_b, -5.0)
    c["logprobs_moved_logits_did_not"] = Case(
        R(BASE, rows={T: raw_a}),
        R(flipped(T, Y), rows={T: moved}),
        opts={"raw": True},
        nums=(round(moved[1][1] - raw_a[0][1], 2),),
    )
    # B's logits say its choice is top-1 (tied with A's token); B's logprobs say a third token
    # Z is 11.7 nats above both. Logits and logprobs are compared only on the gap between the
    # two candidates, and greedy only on the logits.
    c["logprob_top1_not_logit_top1"] = Case(
        R(BASE, rows={T: softmax_row([(X, 8.5), (Y, 8.5)], filler=(4.0, 3.0, 2.0))}),
        R(flipped(T, Y), rows={T: [(Y, -11.7, 8.5), (X, -11.7, 8.5), (Z, -0.0001, 5.0)]}),
        opts={"raw": True},
        words=(str(Z),),
        nums=(11.7,),
    )
    # B's row carries raw logits for the two candidates only; the third token Z (listed first,
    # logprob -0.0001) has none, so it is left out of B's top-1 and B's choice is "greedy".
    c["top1_without_logit_ignored"] = Case(
        R(BASE, rows={T: softmax_row([(X, 8.5), (Y, 8.5)], filler=(4.0, 3.0, 2.0))}),
        R(flipped(T, Y), rows={T: [(Z, -0.0001, None), (Y, -11.7, 8.5), (X, -11.7, 8.5)]}),
        opts={"raw": True},
        words=(str(Z),),
        nums=(11.7,),
    )
    # B's logit for A's token is -inf (masked) while its logprob says -0.83: a non-finite
    # logit silently sends the check to nats, where it is a tie.
    c["masked_candidate_logit_neginf"] = Case(
        R(BASE, rows={T: raw_a}),
        R(flipped(T, Y), rows={T: [raw_b[0], (X, raw_b[1][1], -math.inf), *raw_b[2:]]}),
        opts={"raw": True},
        words=("inf",),
    )

    # -- non-finite, impossible or malformed top-k values --------------------------------
    # A +inf logit (the token would be certain) in B's top-k is dropped as non-finite.
    c["inf_logit_in_topk"] = Case(
        R(BASE, rows={T: raw_a}),
        R(flipped(T, Y), rows={T: [(Z, math.nan, math.inf)] + raw_b}),
        opts={"raw": True},
        words=("inf",),
    )
    # ... and a +inf logprob, logprobs only.
    c["inf_logprob_in_topk"] = Case(
        R(BASE, rows={T: tie_a}), R(flipped(T, Y), rows={T: [(Z, math.inf)] + tie_b}), words=("inf",)
    )
    # An unknown id (-1: a top-k string capture could not map) tops B's row, 0.9 nats above
    # B's choice: masked out of B's top-1, so B's choice passes as greedy.
    c["unknown_id_is_top1"] = Case(
        R(BASE, rows={T: [(X, -1.2), (Y, -1.2), (1000, -3.0)]}),
        R(flipped(T, Y), rows={T: [(-1, -0.6), (Y, -1.5), (X, -1.6), (1000, -3.0)]}),
        nums=(0.9,),
    )
    # Logprobs > 0 (probabilities above 1): raw logits 2.5 / 2.0 stored under the logprob
    # name. As logits at |x| in [2, 4) they are 32 BF16 steps apart, not a tie.
    c["positive_logprobs"] = Case(
        R(BASE, rows={T: [(X, 2.5), (Y, 2.0), (1000, 1.0)]}),
        R(flipped(T, Y), rows={T: [(Y, 2.5), (X, 2.0), (1000, 1.0)]}),
        nums=(2.5,),
    )
    # Both candidates at logprob -0.05: probabilities 0.95 + 0.95 = 1.9 in one row.
    c["probabilities_sum_over_one"] = Case(
        R(BASE, rows={T: [(X, -0.05), (Y, -0.05)]}),
        R(flipped(T, Y), rows={T: [(Y, -0.05), (X, -0.06)]}),
        nums=(1.9,),
    )
    # B's top-k lists A's token twice: -0.83 (read: a tie) and -12 (ignored).
    c["duplicate_id_in_topk"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: tie_b[:2] + [(X, -12.0)] + tie_b[2:]}),
        nums=(12.0,),
    )

    # -- greedy ------------------------------------------------------------------------------
    # Nothing moved: A's and B's rows hold the same numbers (X 3 BF16 steps above Y in both),
    # yet B chose Y, the lower one. A greedy engine cannot choose differently from identical
    # numbers; the greedy check allows 4 steps below the own top-1 and the tie test takes |gap|
    # (the rule text even says "each chose its own top-1").
    low = softmax_row([(X, 18.375), (Y, 18.0)])
    c["b_chose_lower_candidate_nothing_moved"] = Case(
        R(BASE, rows={T: low}), R(flipped(T, Y), rows={T: low}), opts={"raw": True}, words=("B chose token 99",)
    )
    c["b_chose_lower_candidate_logprobs"] = Case(
        R(BASE, rows={T: [x[:2] for x in low]}),
        R(flipped(T, Y), rows={T: [x[:2] for x in low]}),
        words=("B chose token 99",),
    )

    return c


CASES = cases()

# What fooled the classifier before its fix: the wrong verdict it gave and the check that was missing.
FIXED = {
    "chosen_lp_contradicts_topk": "bf16_tie_flip; the chosen logprob column is never checked against the "
    "chosen token's own top-k entry",
    "nan_column_hides_topk_drift": "identical ('drift not verified'); drift is read only from the chosen "
    "logprob column, never from the top-k rows that hold the same values",
    "nan_both_sides_hides_topk_drift": "identical (bitwise); a NaN on both sides is skipped although the "
    "top-k rows hold the chosen logprobs",
    "column_disagrees_with_topk_before_flip": "identical; the chosen logprob column is never checked against "
    "the top-k rows",
    "neginf_chosen_everywhere": "identical; a side whose chosen logprobs are all -inf counts as 'stored none'",
    "logprobs_moved_logits_did_not": "bf16_tie_flip; with logits on both sides the candidates' logprob "
    "movement (-5 nats) is not checked",
    "logprob_top1_not_logit_top1": "bf16_tie_flip; greedy is checked on logits only, logits vs logprobs only "
    "on the two candidates' gap",
    "top1_without_logit_ignored": "bf16_tie_flip; a top-k entry without a raw logit is left out of the top-1",
    "masked_candidate_logit_neginf": "bf16_tie_flip; a -inf logit silently falls back to the nats test",
    "inf_logit_in_topk": "bf16_tie_flip; a +inf logit is dropped from the top-1 as non-finite",
    "inf_logprob_in_topk": "bf16_tie_flip; a +inf logprob is dropped from the top-1 as non-finite",
    "unknown_id_is_top1": "bf16_tie_flip; an id -1 above B's choice is masked out of the top-1",
    "positive_logprobs": "bf16_tie_flip; logprobs > 0 are not rejected",
    "probabilities_sum_over_one": "bf16_tie_flip; a top-k whose probabilities sum to 1.9 is not rejected",
    "duplicate_id_in_topk": "bf16_tie_flip; a top-k row with a repeated id is read at its first entry",
    "b_chose_lower_candidate_nothing_moved": "bf16_tie_flip ('each chose its own top-1'); the sign of B's gap "
    "is ignored (|gap|) and greedy allows 4 steps below the top-1 even when nothing moved",
    "b_chose_lower_candidate_logprobs": "bf16_tie_flip; as above, in nats",
}
FOOLED: dict[str, str] = {}  # what fools it today


test_records_name_cases_of_this_family, test_bug_is_not_benign = family_tests(CASES, FIXED, FOOLED)


@pytest.mark.parametrize(
    "name", marked(["nan_column_hides_topk_drift", "b_chose_lower_candidate_nothing_moved"], FOOLED, "fooled")
)
def test_bug_exits_1_via_the_cli(tmp_path, name):
    cli_exits_1(tmp_path, CASES[name])
