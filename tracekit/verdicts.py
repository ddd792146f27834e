"""The verdict classes of `tracekit diff`: one home for their names, order, which are benign and
which fail, their labels and plot colours.

The enum's order is the order everywhere a class is listed (the summary line, the JSON summary,
report columns, plot columns and legends): identical, the benign divergences, then the failing
classes. It is not the order in which `analyze/classify.py` decides a pair (incomparable
first, unexplained last): that precedence is PRECEDENCE. Members are `str`s, so they compare,
hash, format and serialise as their plain values ("bf16_tie_flip"); JSON stays strings.
"""

from __future__ import annotations

from enum import Enum


class Verdict(str, Enum):
    IDENTICAL = "identical"
    BF16_TIE_FLIP = "bf16_tie_flip"
    POST_EOS = "post_eos"
    CACHE_BOUNDARY = "cache_boundary"
    UNEXPLAINED = "unexplained"
    INCOMPARABLE = "incomparable"

    def __str__(self) -> str:  # f"{v}" is the plain name on every Python (3.10's str-Enum says Verdict.X)
        return self.value

    @property
    def benign(self) -> bool:
        """A divergence the taxonomy explains (not identical, not failing)."""
        return self in BENIGN

    @property
    def failing(self) -> bool:
        """A pair of this class fails the comparison (exit 1)."""
        return self in FAILING

    @property
    def label(self) -> str:
        """Words for axes and legends: 'bf16 tie flip'."""
        return self.value.replace("_", " ")

    @property
    def colour(self) -> str:
        """The plot colour (matplotlib hex)."""
        return COLOURS[self]


VERDICTS: tuple[Verdict, ...] = tuple(Verdict)
NAMES: tuple[str, ...] = tuple(v.value for v in Verdict)  # the display order, as plain strings
BENIGN: tuple[Verdict, ...] = (Verdict.BF16_TIE_FLIP, Verdict.POST_EOS, Verdict.CACHE_BOUNDARY)
FAILING: tuple[Verdict, ...] = (Verdict.UNEXPLAINED, Verdict.INCOMPARABLE)
DIVERGENT: tuple[Verdict, ...] = tuple(v for v in Verdict if v is not Verdict.IDENTICAL)  # benign, then failing
# The classifier's precedence: a pair takes the first class whose rule fires, in this order.
PRECEDENCE: tuple[Verdict, ...] = (
    Verdict.INCOMPARABLE,
    Verdict.IDENTICAL,
    Verdict.POST_EOS,
    Verdict.BF16_TIE_FLIP,
    Verdict.CACHE_BOUNDARY,
    Verdict.UNEXPLAINED,
)

COLOURS = {
    Verdict.IDENTICAL: "#9e9e9e",
    Verdict.BF16_TIE_FLIP: "#1e88e5",
    Verdict.POST_EOS: "#8e24aa",
    Verdict.CACHE_BOUNDARY: "#43a047",
    Verdict.UNEXPLAINED: "#e53935",
    Verdict.INCOMPARABLE: "#fb8c00",
}
