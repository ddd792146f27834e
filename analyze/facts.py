"""The numbers a verdict rests on, per pair [P]: one home for each side's evidence.

`SideEvidence` holds everything about one side of every pair: its stream (token at
the first difference, length, truncation, reused-prefix boundary, grid) and what
its top-k row at the first difference says (gap, below, agree, move, the row's
own soundness numbers). One instance per side; `Facts` holds the two sides and
the pair-level numbers (drift, EOS, tolerances). classify.py builds a Facts,
checks.py judges it, rules.py words it.

The result columns of a DiffResult (diff JSON, run reports) keep their names
(`gap_a`, `gap_b_ulp`, `b_in_topk_a`, ...): `columns()` is the one place that
names them. Nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .positions import Drift

# Kinds of comparable pair (incomparable pairs are NONE)
NONE, SAME, LENGTH, FLIP = 0, 1, 2, 3  # same ids and length / same ids, lengths differ / ids differ at t


def _nan(P: int) -> np.ndarray:
    return np.full(P, np.nan)


@dataclass
class SideEvidence:
    """One side of every pair [P]. At the first difference t the side chose token x (its
    own) and the other side y. Row fields are NaN / False / -1 where no top-k row was
    read (no difference, or the side ended first); distances are nats, `*_ulp` steps of
    the pair's grid from raw logits (NaN without them)."""

    # the stream
    token: np.ndarray  # [P] int64 its token at t, -1 when none
    n: np.ndarray  # [P] its length (tokens)
    trunc: np.ndarray  # [P] object: why the stream counts as cut short ('' when complete)
    boundary: np.ndarray  # [P] int64 cached_tokens (reused-prefix boundary), -1 unknown
    boundary_valid: np.ndarray  # [P] bool: not beyond the prompt
    prompt_len: np.ndarray  # [P] int64, -1 unknown
    dtype: np.ndarray  # [P] object: the grid this side is judged on
    # its top-k row at t (evidence.measure)
    gap: np.ndarray  # value(x) - value(y), a lower bound when y is not in the row
    gap_ulp: np.ndarray
    below: np.ndarray  # how far x lies below the row's top-1 (greedy: ~0)
    below_ulp: np.ndarray  # (on the side's own grid)
    top1: np.ndarray  # [P] int64 the row's top-1 id (by logit where x lies below it by logit)
    lp_top: np.ndarray  # the row's largest logprob, and largest logit
    lg_top: np.ndarray
    agree: np.ndarray  # logit gap - logprob gap
    agree_tol: np.ndarray  # the tie tolerance at the row's scale (nats)
    move: np.ndarray  # value_B(x) - value_A(x): how far this side's token moved from A to B
    move_ulp: np.ndarray
    lse: np.ndarray  # the part of that logprob move its logit did not make (the normaliser's shift)
    lse_tol: np.ndarray
    own_in_topk: np.ndarray  # [P] bool: x in its own row
    other_in_topk: np.ndarray  # [P] bool: y in its row (when False, gap is only a lower bound)
    row_bad: np.ndarray  # [P] int64 evidence.* flags of what is wrong with the row itself
    prob_sum: np.ndarray  # the row's probabilities summed
    col_lp: np.ndarray  # the chosen-logprob column's value
    topk_lp: np.ndarray  # x's entry in the row (the column's value when x is absent)
    max_lp: np.ndarray  # the row's largest logprob over listed ids
    unk_above: np.ndarray  # how far an unknown id (-1) lies above x
    dup_id: np.ndarray  # the first id listed twice, and its first two logprobs
    dup_lp1: np.ndarray
    dup_lp2: np.ndarray
    lg_mine: np.ndarray  # raw logits of x and y in the row
    lg_other: np.ndarray


STREAM = ("token", "n", "trunc", "boundary", "boundary_valid", "prompt_len", "dtype")
ROW = tuple(f.name for f in dataclasses.fields(SideEvidence) if f.name not in STREAM)
_ROW_FILL = {"top1": -1, "row_bad": 0, "own_in_topk": False, "other_in_topk": False}


def empty_rows(P: int) -> dict[str, np.ndarray]:
    """The row fields of P pairs without a row read: NaN, False, -1, 0."""
    out = {}
    for name in ROW:
        fill = _ROW_FILL.get(name, np.nan)
        out[name] = np.full(P, fill, dtype=bool if fill is False else np.int64 if fill in (-1, 0) else np.float64)
    return out


def side_evidence(stream: Mapping[str, np.ndarray], rows: Mapping[str, np.ndarray], at: np.ndarray) -> SideEvidence:
    """A side [P] from its stream fields [P] and its measured row fields [D] at pairs `at` [D]."""
    P = len(stream["token"])
    full = empty_rows(P)
    for name, v in rows.items():
        full[name][at] = v
    return SideEvidence(**stream, **full)


@dataclass
class Facts:
    """Every number of every pair [P] the checks read. Sides: `a` (the reference A) and `b`."""

    key: np.ndarray
    incomparable: np.ndarray  # [P] object: why not comparable ('' when comparable)
    kind: np.ndarray  # [P] int8: NONE / SAME / LENGTH / FLIP
    position: np.ndarray  # [P] first difference, -1 where the ids and lengths agree
    compared: np.ndarray  # [P] positions compared (the shorter length)
    a: SideEvidence
    b: SideEvidence
    topk_overlap: np.ndarray  # share of A's top-k ids in B's at t
    dtype: np.ndarray  # [P] object: the pair's grid (the coarser side's)
    tol: Mapping[str, np.ndarray]  # classify.Tol fields [P] for each pair's grid
    main: Drift  # before t
    sound: Drift  # up to and including A's EOS (post_eos)
    on_logits: np.ndarray  # [P] drift measured on raw logits (steps) instead of logprobs
    drift_tol: np.ndarray  # [P] drift max bound, in the drift's unit
    drift_mean_tol: np.ndarray
    eos_pos: np.ndarray  # [P] A's first EOS before t, -1 none
    eos_id: np.ndarray
    eos_known: np.ndarray  # [P] bool: EOS ids were known
    eos_refuted: np.ndarray  # [P] object: why the EOS is refuted ('' when not)
    eos_skip: Any  # eos_policy.Skipped
    boundary_differs: np.ndarray  # [P] bool: both boundaries known, valid and different
    vllm_close: np.ndarray  # [P] int8 1 / 0 / -1 n/a
    note: np.ndarray  # [P] object
    extra: dict = field(default_factory=dict)  # columns passed through as they are

    @property
    def comparable(self) -> np.ndarray:
        return self.kind != NONE

    def sides(self) -> tuple[tuple[str, SideEvidence, SideEvidence], ...]:
        """(label, side, other side) for A then B."""
        return (("A", self.a, self.b), ("B", self.b, self.a))


# -- the boundary: result column names -------------------------------------------------------

_ROW_COLUMNS = (  # SideEvidence field -> result column, {s} the side ('a' / 'b')
    ("gap", "gap_{s}"),
    ("gap_ulp", "gap_{s}_ulp"),
    ("below", "below_{s}"),
    ("below_ulp", "below_{s}_ulp"),
    ("agree", "agree_{s}"),
    ("agree_tol", "agree_tol_{s}"),
    ("move", "move_{s}"),
    ("move_ulp", "move_{s}_ulp"),
    ("prob_sum", "prob_sum_{s}"),
    ("lse", "lse_{s}"),
    ("lse_tol", "lse_tol_{s}"),
    ("col_lp", "col_lp_{s}"),
    ("max_lp", "max_lp_{s}"),
    ("unk_above", "unk_above_{s}"),
    ("dup_id", "dup_id_{s}"),
    ("dup_lp1", "dup_lp1_{s}"),
    ("dup_lp2", "dup_lp2_{s}"),
    ("topk_lp", "topk_lp_{s}"),
    ("lg_mine", "lg_mine_{s}"),
    ("lg_other", "lg_other_{s}"),
    ("own_in_topk", "own_in_topk_{s}"),
    ("top1", "top1_{s}"),
    ("row_bad", "row_bad_{s}"),
    ("token", "token_{s}"),
    ("boundary", "boundary_{s}"),
    ("boundary_valid", "boundary_valid_{s}"),
    ("prompt_len", "prompt_len_{s}"),
    ("n", "len_{s}"),
    ("dtype", "dtype_{s}"),
    ("trunc", "trunc_{s}"),
)
OTHER_IN_TOPK = {"a": "b_in_topk_a", "b": "a_in_topk_b"}  # y in s's top-k: named by the token


def columns(f: Facts, side_flags: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """The DiffResult columns of the facts. side_flags: {column stem: (A's, B's)} per-side
    check results (greedy_ok, tie_ok, ...), written as `{stem}_a` / `{stem}_b`."""
    out: dict[str, np.ndarray] = {}
    for s, side in (("a", f.a), ("b", f.b)):
        out.update({col.format(s=s): getattr(side, name) for name, col in _ROW_COLUMNS})
        out[OTHER_IN_TOPK[s]] = side.other_in_topk
        for stem, (va, vb) in side_flags.items():
            out[f"{stem}_{s}"] = va if s == "a" else vb
    d, e = f.main, f.sound
    out.update(
        key=f.key,
        position=f.position,
        incomparable=f.incomparable,
        compared=f.compared,
        topk_overlap=f.topk_overlap,
        dtype=f.dtype,
        drift_max=d.max,
        drift_mean=d.mean,
        drift_n=d.n,
        drift_on_logits=f.on_logits,
        drift_raw_max=d.raw_max,
        drift_tol=f.drift_tol,
        drift_mean_tol=f.drift_mean_tol,
        nonfinite=d.nonfinite,
        nonfinite_pos=d.nonfinite_pos,
        nonfinite_a=d.nonfinite_a,
        nonfinite_b=d.nonfinite_b,
        inconsistent=d.inconsistent,
        inconsistent_pos=d.inconsistent_pos,
        inconsistent_side=d.inconsistent_said[:, 0],
        inconsistent_col=d.inconsistent_said[:, 1],
        inconsistent_topk=d.inconsistent_said[:, 2],
        sound_drift_max=e.max,
        sound_drift_n=e.n,
        sound_drift_mean=e.mean,
        sound_nonfinite=e.nonfinite,
        sound_nonfinite_pos=e.nonfinite_pos,
        sound_inconsistent=e.inconsistent,
        sound_inconsistent_pos=e.inconsistent_pos,
        bitwise=d.bitwise & f.comparable,
        vllm_close=f.vllm_close,
        eos_pos=f.eos_pos,
        eos_id=f.eos_id,
        eos_known=f.eos_known,
        eos_refuted=f.eos_refuted,
        eos_skip=f.eos_skip.head,
        eos_skipped_by=f.eos_skip.by,
        boundary_differs=f.boundary_differs,
        note=f.note,
        **{f"tol_{k}": v for k, v in f.tol.items()},
        **f.extra,
    )
    return out
