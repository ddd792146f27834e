"""Red team, EOS and truncated streams: EOS ids that the streams refute, a stream that ran past EOS,
and streams cut short.

Builders and the method: redteam_builders.py."""

from __future__ import annotations

from support.redteam_builders import (
    BASE,
    EOS,
    GREEDY,
    Case,
    R,
    T,
    Y,
    family_tests,
    flipped,
    tie_rows,
)


def cases() -> dict[str, Case]:
    """Bugs: EOS and truncated streams."""
    c: dict[str, Case] = {}
    tie_a, tie_b = tie_rows(raw=False)

    # -- EOS ------------------------------------------------------------------------------------
    # A's metadata says EOS 2, B's says 6 (contradicting). 6 is an ordinary token A emitted at
    # position 1 and the stream went on (ignore_eos false): it is no EOS. B's token 4242 at 2
    # lies outside A's top-k, yet the union of both lists excuses it as post_eos.
    noeos = {**GREEDY, "ignore_eos": False}
    c["eos_from_b_contradicts_a"] = Case(
        R(BASE, params=noeos), R(flipped(T, 4242), params=noeos), opts_b={"eos": (6,)}, words=("4242",)
    )
    # ... and B's metadata the only one naming an EOS id.
    c["eos_from_b_only"] = Case(
        R(BASE, params=noeos),
        R(flipped(T, 4242), params=noeos),
        opts={"eos": None},
        opts_b={"eos": (6,)},
        words=("4242",),
    )
    # B ran past the EOS although it was asked not to ignore it (ignore_eos false, max 6):
    # B's EOS handling is broken. Called "A stopped at EOS, B ignored it and went on".
    c["b_ran_past_eos_not_ignored"] = Case(
        R([5, 6, EOS], params=noeos, finish="stop"),
        R([5, 6, EOS, 8, 9, 10], params=noeos, finish="length"),
        words=("EOS",),
    )

    # -- truncated streams ------------------------------------------------------------------------
    # Both streams cut at 3 of the 6 tokens asked (finish_reason length): "identical".
    c["identical_but_both_truncated"] = Case(R(BASE[:3], params=GREEDY), R(BASE[:3], params=GREEDY), words=("3 of 6",))
    # Both engines returned nothing: 0 tokens, no finish reason, status ok: "identical".
    c["both_empty_no_finish"] = Case(
        R([], params=GREEDY, finish=""), R([], params=GREEDY, finish=""), words=("finish reason",)
    )
    # A seed-sized tie flip, but B's stream died right after it (4 of 6 tokens, no finish
    # reason): truncation is checked only for length mismatches and post_eos pairs.
    c["tie_then_b_cut"] = Case(
        R(BASE, rows={T: tie_a}, params=GREEDY),
        R(flipped(T, Y)[:4], rows={T: tie_b}, params=GREEDY, finish=""),
        words=("finish reason",),
    )

    return c


CASES = cases()

# What fooled the classifier before its fix: the wrong verdict it gave and the check that was missing.
FIXED = {
    "eos_from_b_contradicts_a": "post_eos; EOS ids are the union of both traces' lists, B's contradicting A's",
    "eos_from_b_only": "post_eos; an EOS id the stream itself refutes (continued past it, ignore_eos false)",
    "b_ran_past_eos_not_ignored": "post_eos; B going on past EOS with ignore_eos false is not checked",
    "identical_but_both_truncated": "identical; truncation is not checked for identical pairs",
    "both_empty_no_finish": "identical; truncation is not checked for identical pairs",
    "tie_then_b_cut": "bf16_tie_flip; truncation is checked only for length mismatches and post_eos",
}
FOOLED: dict[str, str] = {}  # what fools it today


test_records_name_cases_of_this_family, test_bug_is_not_benign = family_tests(CASES, FIXED, FOOLED)
