"""DiffResult: the numbers of one A-vs-B comparison (numpy columns inside),
with the rule text of every verdict and a JSON form (`tracekit.diff/2`).

A DiffResult also acts as the pass/fail of the comparison: `ok` is False
when any pair is `unexplained` or `incomparable`. The rule texts live in
rules.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from tracekit.verdicts import FAILING as _FAILING
from tracekit.verdicts import NAMES

from .classify import CLASSES, Thresholds
from .grid import Grid

__all__ = ["SCHEMA", "FAILING", "PairResult", "DiffResult"]

SCHEMA = "tracekit.diff/2"
FAILING = tuple(v.value for v in _FAILING)  # tracekit/verdicts.py


def _f(x: float) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _i(x: int) -> int | None:
    return None if int(x) < 0 else int(x)


def _s(x: str) -> str | None:
    return str(x) or None


@dataclass(frozen=True)
class PairResult:
    """One pair's verdict and evidence. None = unknown / not applicable.
    Side a is the reference A; `*_a` numbers are measured in A, `*_b` in B,
    except move_a / move_b: how far token_a / token_b moved from A to B."""

    key: str
    cls: str
    position: int | None
    token_a: int | None
    token_b: int | None
    gap_a: float | None  # nats: logprob_A(token_a) - logprob_A(token_b)
    gap_b: float | None  # nats: logprob_B(token_b) - logprob_B(token_a)
    gap_a_ulp: float | None  # the same gaps in steps of the pair's grid, from raw logits
    gap_b_ulp: float | None
    top1_a: int | None  # each side's own top-1 at the position
    top1_b: int | None
    below_a: float | None  # nats its chosen token lies below its own top-1 (greedy: ~0)
    below_b: float | None
    below_a_ulp: float | None
    below_b_ulp: float | None
    move_a: float | None  # logprob_B(token_a) - logprob_A(token_a), nats
    move_b: float | None  # logprob_B(token_b) - logprob_A(token_b)
    move_a_ulp: float | None  # the same from raw logits, steps
    move_b_ulp: float | None
    agree_a: float | None  # logit gap - logprob gap in A (nats; ~0 when both tell the same)
    agree_b: float | None
    boundary_a: int | None  # cached_tokens (reused-prefix boundary)
    boundary_b: int | None
    drift_max: float | None  # max |Δ chosen logprob| before the divergence (drift_unit)
    drift_mean: float | None
    drift_n: int  # positions the drift is measured over
    drift_unit: str  # "nats" (logprobs), or "ulp": raw logits of a trace that stores no logprobs
    nonfinite: int  # positions before the divergence with NaN/inf on one side only
    nonfinite_pos: int | None
    inconsistent: int  # positions where a logprob column contradicts the token's own top-k entry
    bitwise: bool  # chosen logprobs bitwise equal before the divergence
    topk_overlap: float | None  # share of A's top-k ids in B's top-k at the divergence
    vllm_close: bool | None  # check_logprobs_close's verdict
    len_a: int
    len_b: int
    dtype_a: str  # the grid each side is judged on
    dtype_b: str
    truncated_a: str | None  # why a stream counts as cut short (checked where it matters)
    truncated_b: str | None
    rule: str
    note: str | None = None
    teacher: str | None = None  # the --teacher-forced verdict
    b_in_topk_a: bool | None = None  # when False, gap_a is only a lower bound
    a_in_topk_b: bool | None = None

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "cls"}
        return {"key": d.pop("key"), "class": self.cls, **d}


def _flag(c, name: str, i: int) -> bool | None:
    # Only meaningful where a divergence row exists in both traces.
    return bool(c[name][i]) if 0 <= c["position"][i] < c["compared"][i] else None


@dataclass(frozen=True)
class DiffResult:
    """One comparison of trace B against the reference A."""

    a: str
    b: str
    thresholds: Thresholds
    eos_ids: tuple[int, ...]
    eos_source: str
    columns: Mapping[str, np.ndarray]  # classify() columns + rule + teacher, each [P]
    notes: tuple[str, ...] = ()
    grids: Mapping[str, Grid] = field(default_factory=dict)  # "a"/"b": the run-level grid
    labels: Mapping[str, str] = field(default_factory=dict)  # "a"/"b": what each trace is (run metadata)
    flip_test: Any = None  # flip_rate.FlipTest against --calibration; None when judged uncalibrated
    reference: Any = None  # reference.PairReference against --reference; None without one

    def __len__(self) -> int:
        return len(self.columns["key"])

    def pair(self, i: int) -> PairResult:
        c = self.columns
        vc = int(c["vllm_close"][i])
        floats = {
            k: _f(c[k][i])
            for k in (
                "gap_a",
                "gap_b",
                "gap_a_ulp",
                "gap_b_ulp",
                "below_a",
                "below_b",
                "below_a_ulp",
                "below_b_ulp",
                "move_a",
                "move_b",
                "move_a_ulp",
                "move_b_ulp",
                "agree_a",
                "agree_b",
                "drift_max",
                "drift_mean",
                "topk_overlap",
            )
        }
        return PairResult(
            key=str(c["key"][i]),
            cls=str(c["cls"][i]),
            position=_i(c["position"][i]),
            token_a=_i(c["token_a"][i]),
            token_b=_i(c["token_b"][i]),
            top1_a=_i(c["top1_a"][i]),
            top1_b=_i(c["top1_b"][i]),
            boundary_a=_i(c["boundary_a"][i]),
            boundary_b=_i(c["boundary_b"][i]),
            drift_n=int(c["drift_n"][i]),
            drift_unit="ulp" if c["drift_on_logits"][i] else "nats",
            inconsistent=int(c["inconsistent"][i]),
            nonfinite=int(c["nonfinite"][i]),
            nonfinite_pos=_i(c["nonfinite_pos"][i]),
            bitwise=bool(c["bitwise"][i]),
            vllm_close=None if vc < 0 else bool(vc),
            len_a=int(c["len_a"][i]),
            len_b=int(c["len_b"][i]),
            dtype_a=str(c["dtype_a"][i]),
            dtype_b=str(c["dtype_b"][i]),
            truncated_a=_s(c["trunc_a"][i]),
            truncated_b=_s(c["trunc_b"][i]),
            rule=str(c["rule"][i]),
            note=_s(c["note"][i]),
            teacher=c["teacher"][i],
            b_in_topk_a=_flag(c, "b_in_topk_a", i),
            a_in_topk_b=_flag(c, "a_in_topk_b", i),
            **floats,
        )

    @property
    def pairs(self) -> tuple[PairResult, ...]:
        return tuple(self.pair(i) for i in range(len(self)))

    def by_key(self, key: str) -> PairResult:
        hit = np.flatnonzero(self.columns["key"] == key)
        if not len(hit):
            raise KeyError(key)
        return self.pair(int(hit[0]))

    def counts(self) -> dict[str, int]:
        cls = self.columns["cls"]
        return {"pairs": len(self), **{name: int(np.sum(cls == name)) for name in CLASSES}}

    def findings(self) -> dict[str, int]:
        """Counted whatever the class: one-sided NaN/inf logprobs, logprob columns that
        contradict their top-k rows, truncated streams."""
        c = self.columns
        nf = c["nonfinite"]
        cut = (c["trunc_a"] != "") | (c["trunc_b"] != "")
        inc = c["inconsistent"]
        return {
            "nonfinite_pairs": int((nf > 0).sum()),
            "nonfinite_positions": int(nf.sum()),
            "inconsistent_pairs": int((inc > 0).sum()),
            "truncated_pairs": int(cut.sum()),
        }

    @property
    def ok(self) -> bool:
        c = self.counts()
        return (
            not any(c[name] for name in FAILING)
            and (self.flip_test is None or self.flip_test.ok)
            and (self.reference is None or self.reference.ok)
        )

    def thresholds_json(self) -> dict[str, Any]:
        """The tolerances in force: per dtype judged, and flat for the most common one."""
        dts = self.columns["dtype"]
        used = sorted(set(dts.tolist())) or [self.grids["a"].dtype if self.grids else "bf16"]
        main = max(used, key=lambda d: int(np.sum(dts == d)))
        per = self.thresholds.to_json(used)
        return {
            "dtype": main,
            **per[main],
            "by_dtype": {d: per[d] for d in used},
            "given": per["given"],
            "grid_floor": per["grid_floor"],
        }

    def _reference_json(self) -> dict[str, Any]:
        r = self.reference
        names = ("n", "err_a", "err_b", "p99_a", "p99_b", "top1_a", "top1_b", "ratio", "ratio_lo", "ratio_hi")
        pairs = {
            str(k): {"verdict": r.verdict[i] or "consistent", **{n: _f(getattr(r, n)[i]) for n in names}}
            | {"p_b_farther": _f(r.p_b_farther[i]), "p_a_farther": _f(r.p_a_farther[i])}
            for i, k in enumerate(self.columns["key"].tolist())
            if r.verdict[i] != "no reference"
        }
        run = {"pairs": r.run_pairs, "median_ratio": _f(r.run_median_ratio), "p_b_farther": r.run_p_b}
        run |= {"p_a_farther": r.run_p_a, "verdict": r.run_verdict or "consistent", "ok": r.ok}
        run["equal_pairs_left_out"] = r.run_equal
        return {"source": r.source, "run": run, "pairs": pairs}

    def to_json(self, only: Sequence[str] | None = None) -> dict[str, Any]:
        s = self.counts()
        order = ("pairs", *NAMES)
        th = self.thresholds_json()
        return {
            "schema": SCHEMA,
            "a": self.a,
            "b": self.b,
            "labels": dict(self.labels),
            "summary": {k: s[k] for k in order},
            "findings": self.findings(),
            "thresholds": th,
            "grids": {k: {"dtype": g.dtype, "source": g.source, "known": g.known} for k, g in self.grids.items()},
            "eos_token_ids": list(self.eos_ids),
            "eos_source": self.eos_source,
            "notes": list(self.notes),
            "calibration": None if self.flip_test is None else self.flip_test.to_json(),
            "reference": None if self.reference is None else self._reference_json(),
            "only": list(only) if only else None,
            "pairs": [p.to_json() for p in self.pairs if not only or p.cls in only],
        }
