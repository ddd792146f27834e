"""The taxonomy's checks: a table of named checks, each a vectorised mask over the pairs.

A benign class is a claim and every part of it is a check here (docs/analysis.md):

    Check(name, gates, says, mask, reason)

`mask(f)` is [P] bool, True where the pair passes; `gates` the classes that need it to
pass; `reason(f, i)` why pair i fails it, one line with its numbers ([] when another check
says it); `says(f)` [P] the pairs whose rule text quotes it. A class holds where its premise
(CLAIMS: what kind of pair it speaks of) does and every check that gates it passes; the
verdict is the first class in tracekit.verdicts' precedence that holds; an `unexplained`
pair's rule text is the reasons of its failed checks, in the table's order (the most telling
first). Reads facts.Facts only; the numbers are measured elsewhere (positions.py, evidence.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .evidence import CAND_LOGIT, COLUMN, DUP_ID, GREEDY_NATS, POS_INF, POSITIVE_LP, SUM_OVER_ONE, UNKNOWN_ABOVE
from .facts import FLIP, LENGTH, SAME, Facts, SideEvidence
from .positions import drift_ok
from .wording import dist, drift_failures, num, signed, tol

TIE, BOUNDARY, POST, IDENTICAL = "bf16_tie_flip", "cache_boundary", "post_eos", "identical"
FLIPS = (TIE, BOUNDARY)
BENIGN = (IDENTICAL, POST, *FLIPS)


@dataclass(frozen=True)
class Check:
    name: str
    gates: tuple[str, ...]  # the classes that need it to pass
    says: Callable[[Facts], np.ndarray]  # [P] bool: pairs whose `unexplained` text quotes its failure
    mask: Callable[[Facts], np.ndarray]  # [P] bool: passes
    reason: Callable[[Facts, int], list[str]]  # why pair i fails it, with its numbers


# -- the masks -------------------------------------------------------------------------------


def within(ulp: np.ndarray, nats: np.ndarray, tol_ulp: np.ndarray, tol_nats: np.ndarray) -> np.ndarray:
    """|value| within tolerance: in steps where measured on logits, else in nats (NaN fails)."""
    return np.where(np.isfinite(ulp), np.abs(ulp) <= tol_ulp, np.abs(nats) <= tol_nats)


def greedy_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    """The chosen token is in its own row and its top-1 by logit AND by logprob, ties allowed.
    Engines report the values they take the argmax of, and rounding is monotone."""
    by_logit = ~np.isfinite(s.lg_top) & ~np.isposinf(s.lg_top) | (s.below_ulp <= 0)
    by_logprob = np.isnan(s.below) | (s.below <= GREEDY_NATS * np.maximum(1, np.abs(s.lp_top)))
    return s.own_in_topk & by_logit & by_logprob


def tie_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    return s.other_in_topk & within(s.gap_ulp, s.gap, f.tol["tie_ulps"], f.tol["tie_nats"])


def tie_move_ok(f: Facts) -> np.ndarray:
    """[P] the flip's total move, A's gap + B's gap (the candidates' gap went from +g_A in A to -g_B
    in B), within this engine's healthy top-2 gap move (a calibration's; 0 uncalibrated: never)."""
    ulp = np.abs(f.a.gap_ulp) + np.abs(f.b.gap_ulp)
    nats = np.abs(f.a.gap) + np.abs(f.b.gap)
    on = np.where(np.isfinite(ulp), f.tol["tie_move_ulps"] > 0, f.tol["tie_move_nats"] > 0)
    return both_in_topk(f) & on & within(ulp, nats, f.tol["tie_move_ulps"], f.tol["tie_move_nats"])


def tie_gap_ok(f: Facts) -> np.ndarray:
    """[P] a tie: each side's gap within the tie tolerance, or their sum within the healthy gap move."""
    return (tie_ok(f, f.a) & tie_ok(f, f.b)) | tie_move_ok(f)


def num_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    """The gap within the drift tolerance: a numeric-size gap (cache_boundary's)."""
    return s.other_in_topk & within(s.gap_ulp, s.gap, f.tol["drift_ulps"], f.tol["drift_nats"])


def agree_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    return ~np.isfinite(s.agree) | (np.abs(s.agree) <= s.agree_tol)


def move_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    """s's token moved from A to B within the drift tolerance: its logit in steps, its logprob in
    nats without logits, or with logits like its logit up to the normaliser's bounded shift."""
    lp_ok = np.where(np.isfinite(s.move_ulp), ~(np.abs(s.lse) > s.lse_tol), True)
    return within(s.move_ulp, s.move, f.tol["drift_ulps"], f.tol["drift_nats"]) & lp_ok


def row_ok(f: Facts, s: SideEvidence) -> np.ndarray:
    return s.row_bad == 0


def main_drift_ok(f: Facts) -> np.ndarray:
    return drift_ok(f.main, f.drift_tol, f.drift_mean_tol)


def sound_drift_ok(f: Facts) -> np.ndarray:
    return drift_ok(f.sound, f.drift_tol, f.drift_mean_tol)


def both_in_topk(f: Facts) -> np.ndarray:
    return f.a.other_in_topk & f.b.other_in_topk


def in_nats(f: Facts) -> np.ndarray:
    """[P] pairs whose gaps are measured in nats only (no raw logits on either side)."""
    return ~np.isfinite(f.a.gap_ulp) & ~np.isfinite(f.b.gap_ulp)


def one_boundary_or_logits(f: Facts) -> np.ndarray:
    """A tie in nats is a tie at one reused prefix. In nats the tie and the drift tolerance are one
    number per dtype, so a flip across a moved reused prefix on a logprob-only engine (llama.cpp)
    passed the tie first and its boundary was never said; there the boundary claim speaks."""
    return ~(f.boundary_differs & in_nats(f))


# Per-side results written as result columns `{stem}_a` / `{stem}_b` (facts.columns).
SIDE_FLAGS = {
    "greedy_ok": greedy_ok,
    "tie_ok": tie_ok,
    "num_ok": num_ok,
    "agree_ok": agree_ok,
    "move_ok": move_ok,
    "row_ok": row_ok,
}


# -- the reasons -----------------------------------------------------------------------------


def _label(f: Facts, s: SideEvidence) -> str:
    return "A" if s is f.a else "B"


def _drift_reason(f: Facts, i: int) -> list[str]:
    if f.kind[i] == SAME:  # same ids, same length: identical ids, but not sound
        return [f"same {f.compared[i]} token ids, but " + x for x in drift_failures(f, f.main, i, "")]
    return drift_failures(f, f.main, i)


def _same_prefix(f: Facts, i: int, text: str) -> str:
    return f"same {f.compared[i]} token ids, but {text}" if f.kind[i] == SAME else text


def _complete_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    return [_same_prefix(f, i, f"{_label(f, s)}'s stream {s.trunc[i]}")]


def _boundary_valid_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    x = _label(f, s)
    said = f"{x}'s cached_tokens {s.boundary[i]} exceeds its prompt ({s.prompt_len[i]} tokens): no boundary"
    return [_same_prefix(f, i, said)]


def _length_reason(f: Facts, i: int) -> list[str]:
    return [
        f"length mismatch: {f.a.n[i]} vs {f.b.n[i]} tokens, identical up to {f.compared[i]}, no EOS before"
        + ("" if f.eos_known[i] else " (EOS ids unknown)")
    ]


def _row_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    bad = int(s.row_bad[i])
    tok, other = s.token[i], o.token[i]
    cand = [f"token {t}: {lg:g}" for t, lg in ((tok, s.lg_mine[i]), (other, s.lg_other[i])) if not np.isfinite(lg)]
    dup = "an id twice"
    if np.isfinite(s.dup_id[i]):
        dup = f"id {int(s.dup_id[i])} twice ({num(s.dup_lp1[i])}, {num(s.dup_lp2[i])})"
    texts = (
        (
            COLUMN,
            f"contradicts its own logprob column for token {tok} ({num(s.col_lp[i])} vs {num(s.topk_lp[i])} nats)",
        ),
        (DUP_ID, f"lists {dup}"),
        (POS_INF, "holds +inf"),
        (POSITIVE_LP, f"holds a logprob above 0 ({s.max_lp[i]:g})"),
        (SUM_OVER_ONE, f"has probabilities summing to {num(s.prob_sum[i])} (> 1)"),
        (UNKNOWN_ABOVE, f"has an unknown id (-1) {num(s.unk_above[i])} nats above the chosen token"),
        (CAND_LOGIT, f"has logits but none finite for {', '.join(cand) or 'a candidate'}"),
    )
    said = [text for flag, text in texts if bad & flag]
    return [f"{_label(f, s)}'s top-k row at {f.position[i]} " + ", ".join(said)]


def _other_in_topk_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    x, y = _label(f, s), _label(f, o)
    return [f"{y}'s token {o.token[i]} not in {x}'s top-k (gap >= {num(abs(s.gap[i]))} nats)"]


def _greedy_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    x, tok = _label(f, s), s.token[i]
    if not s.own_in_topk[i]:
        return [f"{x} chose token {tok}, not in its own top-k (top-1 {s.top1[i]})"]
    if int(s.row_bad[i]) & (POS_INF | CAND_LOGIT):  # the row check says it: its values cannot rank
        return []
    ulp = s.below_ulp[i]
    below = f"{num(ulp)} ulp" if np.isfinite(ulp) and ulp > 0 else f"{num(s.below[i])} nats"
    return [f"{x} chose token {tok}, {below} below its own top-1 {s.top1[i]} (greedy: its own top-1, ties allowed)"]


def _agree_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    lg = s.gap[i] + s.agree[i]
    return [
        f"{_label(f, s)}'s logits and logprobs disagree: logit gap {num(lg)}, logprob gap {num(s.gap[i])} nats "
        f"(differ by {num(abs(s.agree[i]))} > {num(s.agree_tol[i])})"
    ]


def _move_reason(f: Facts, s: SideEvidence, o: SideEvidence, i: int) -> list[str]:
    tok, ulp, dt, drift_ulps = s.token[i], s.move_ulp[i], f.dtype[i], f.tol["drift_ulps"][i]
    if np.isfinite(ulp) and abs(ulp) <= drift_ulps:  # the logit stayed, the logprob did not
        return [
            f"token {tok}'s logprob moved {signed(s.move[i])} nats from A to B while its logit "
            f"moved {signed(ulp)} ulp (the normaliser shifted {num(abs(s.lse[i]))} nats > "
            f"{num(s.lse_tol[i])} = {drift_ulps:g} ulp here, {dt})"
        ]
    return [f"token {tok} moved {dist(s.move[i], ulp, True)} from A to B (> {tol(f, i, 'drift', ulp)}, {dt})"]


def _gaps(f: Facts, i: int) -> str:
    return f"|gap| A {dist(f.a.gap[i], f.a.gap_ulp[i])}, B {dist(f.b.gap[i], f.b.gap_ulp[i])}"


def _boundaries(f: Facts, i: int) -> tuple[str, str]:
    return tuple(str(x) if x >= 0 else "?" for x in (f.a.boundary[i], f.b.boundary[i]))


def _tie_reason(f: Facts, i: int) -> list[str]:
    if f.boundary_differs[i]:
        return []  # cache_boundary's gap check says it
    ba, bb = _boundaries(f, i)
    why = "unknown" if "?" in (ba, bb) else "equal"
    if not (f.a.boundary_valid[i] and f.b.boundary_valid[i]):
        why = "not valid"
    t = tol(f, i, "tie", f.a.gap_ulp[i])
    out = f"{_gaps(f, i)} beyond the tie tolerance {t} ({f.dtype[i]})"
    if (mv := move_text(f, i)) is not None:
        out += f", and their sum {mv[0]} beyond this engine's healthy top-2 gap move {mv[1]}"
    return [f"{out}, boundaries {why} ({ba} vs {bb})"]


def move_text(f: Facts, i: int) -> tuple[str, str] | None:
    """(A's gap + B's gap, the healthy gap move) as text in the unit measured, None uncalibrated."""
    ulp = abs(f.a.gap_ulp[i]) + abs(f.b.gap_ulp[i])
    if np.isfinite(ulp):
        t = f.tol["tie_move_ulps"][i]
        return (f"{num(ulp)} ulp", f"{t:g} ulp") if t > 0 else None
    t = f.tol["tie_move_nats"][i]
    return (f"{num(abs(f.a.gap[i]) + abs(f.b.gap[i]))} nats", f"{t:g} nats") if t > 0 else None


def _boundary_gap_reason(f: Facts, i: int) -> list[str]:
    if not f.boundary_differs[i]:
        return []  # the tie check says why the boundaries do not count
    ba, bb = _boundaries(f, i)
    t = tol(f, i, "drift", f.a.gap_ulp[i])
    return [f"{_gaps(f, i)} beyond the drift tolerance {t} ({f.dtype[i]}; boundaries {ba} vs {bb})"]


# -- the table -------------------------------------------------------------------------------


def _all(f: Facts) -> np.ndarray:
    return np.ones(len(f.key), bool)


def _never(f: Facts) -> np.ndarray:
    return np.zeros(len(f.key), bool)


def _flip(f: Facts) -> np.ndarray:
    return f.kind == FLIP


def _eos_said(f: Facts) -> np.ndarray:  # the EOS claim is quoted first, for pairs with an EOS before t
    return (f.eos_pos >= 0) & (f.kind != SAME)


def _moved_said(f: Facts) -> np.ndarray:  # a candidate's move is measured only when both are listed
    return _flip(f) & both_in_topk(f)


def _side_check(name: str, x: str, gates, says, mask, reason) -> Check:
    """Check `name` of side x ('a' / 'b'): mask(f, side), reason(f, side, other side, i)."""

    def sides(f: Facts) -> tuple[SideEvidence, SideEvidence]:
        return (f.a, f.b) if x == "a" else (f.b, f.a)

    return Check(f"{name}_{x}", gates, says, lambda f: mask(f, sides(f)[0]), lambda f, i: reason(f, *sides(f), i))


def _each_side(name: str, gates, says, mask, reason) -> tuple[Check, ...]:
    return tuple(_side_check(name, x, gates, says, mask, reason) for x in "ab")


def _row_checks(x: str) -> tuple[Check, ...]:
    """The claims about side x's own row at the first difference."""
    return (
        _side_check("row_sane", x, FLIPS, _flip, row_ok, _row_reason),
        _side_check("other_in_topk", x, FLIPS, _flip, lambda f, s: s.other_in_topk, _other_in_topk_reason),
        _side_check("greedy", x, FLIPS, _flip, greedy_ok, _greedy_reason),
        _side_check("agree", x, FLIPS, _flip, agree_ok, _agree_reason),
    )


CHECKS: tuple[Check, ...] = (
    # post_eos: A emitted an EOS before the first difference, and everything up to it is sound
    Check(
        "sound_drift", (POST,), _eos_said, sound_drift_ok, lambda f, i: drift_failures(f, f.sound, i, "up to A's EOS")
    ),
    Check("eos_not_refuted", (POST,), _eos_said, lambda f: f.eos_refuted == "", lambda f, i: [f.eos_refuted[i]]),
    Check(
        "eos_before", (POST,), lambda f: f.kind == LENGTH, lambda f: f.eos_pos >= 0, lambda f, i: _length_reason(f, i)
    ),
    # drift before the difference (over the whole stream when the ids agree)
    Check("drift", (IDENTICAL, *FLIPS), lambda f: f.kind != LENGTH, main_drift_ok, _drift_reason),
    *_each_side("complete", BENIGN, _all, lambda f, s: s.trunc == "", _complete_reason),
    *_each_side("boundary_valid", (BOUNDARY,), _all, lambda f, s: s.boundary_valid, _boundary_valid_reason),
    # each side's row at the first difference: sane, the other's token listed, greedy, logits = logprobs
    *_row_checks("a"),
    *_row_checks("b"),
    # both candidates moved between A and B within the drift tolerance
    *_each_side("moved", FLIPS, _moved_said, move_ok, _move_reason),
    # the gap between the candidates: a tie in each trace, or a numeric-size gap across a boundary change
    Check("tie_gap", (TIE,), _moved_said, tie_gap_ok, _tie_reason),
    # in nats, a flip whose reused prefixes differ is the boundary claim's (never quoted: it holds)
    Check("tie_at_one_boundary", (TIE,), _never, one_boundary_or_logits, lambda f, i: []),
    Check(
        "boundary_gap",
        (BOUNDARY,),
        _moved_said,
        lambda f: f.boundary_differs & num_ok(f, f.a) & num_ok(f, f.b),
        _boundary_gap_reason,
    ),
)

# The claims, in the order of precedence: (name, class, premise, gated). The premise is the kind of
# pair a class speaks of; gated: the table's checks for the class decide it. post_eos has a second
# claim, the EOS that llama.cpp's ignore_eos skipped: eos_policy.skipped_eos checks it part by part
# (why it does not hold is said in the pair's note).
CLAIMS: tuple[tuple[str, str, Callable[[Facts], np.ndarray], bool], ...] = (
    (IDENTICAL, IDENTICAL, lambda f: f.kind == SAME, True),
    (POST, POST, lambda f: (f.kind == FLIP) | (f.kind == LENGTH), True),
    ("skipped_eos", POST, lambda f: f.eos_skip.head != "", False),
    (TIE, TIE, _flip, True),
    (BOUNDARY, BOUNDARY, _flip, True),
)


@dataclass(frozen=True)
class Judged:
    """The table evaluated over every pair: each check's mask and where its failure is quoted,
    by name, and the verdict of each pair."""

    ok: dict[str, np.ndarray]
    said: dict[str, np.ndarray]
    holds: dict[str, np.ndarray]  # claim name -> [P] bool
    cls: np.ndarray  # [P] object


def judge(f: Facts, checks: tuple[Check, ...] = CHECKS) -> Judged:
    """Evaluate the table; the class of a pair is the first (in CLAIMS' order) whose premise holds
    and whose checks all pass, else `unexplained` (incomparable pairs stay incomparable)."""
    ok = {c.name: np.asarray(c.mask(f), bool) for c in checks}
    said = {c.name: np.asarray(c.says(f), bool) for c in checks}
    cls = np.full(len(f.key), "unexplained", dtype=object)
    holds: dict[str, np.ndarray] = {}
    for claim, name, premise, gated in reversed(CLAIMS):  # later (weaker) first: the stronger overwrite
        h = np.asarray(premise(f), bool).copy()
        if gated:
            for c in checks:
                if name in c.gates:
                    h &= ok[c.name]
        cls[h] = name
        holds[claim] = h
    cls[~f.comparable] = "incomparable"
    return Judged(ok, said, holds, cls)


def failures(f: Facts, j: Judged, i: int, checks: tuple[Check, ...] = CHECKS) -> list[str]:
    """The reasons of pair i's failed checks that its text quotes, in the table's order."""
    out: list[str] = []
    for c in checks:
        if not j.ok[c.name][i] and j.said[c.name][i]:
            out += c.reason(f, i)
    return out


def side_flags(f: Facts) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The per-side results (greedy_ok, tie_ok, ...) of A and B, False where no row was read."""
    read = f.kind == FLIP
    return {stem: (fn(f, f.a) & read, fn(f, f.b) & read) for stem, fn in SIDE_FLAGS.items()}
