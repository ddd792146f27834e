"""DiffResult: the numbers of one A-vs-B comparison (numpy columns inside),
with the rule text of every verdict and a JSON form (`tracekit.diff/1`).

A DiffResult also acts as the pass/fail of the comparison: `ok` is False
when any pair is `unexplained` or `incomparable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .classify import CLASSES, Thresholds

SCHEMA = "tracekit.diff/1"
FAILING = ("unexplained", "incomparable")


def _f(x: float) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _i(x: int) -> int | None:
    return None if int(x) < 0 else int(x)


def _flag(c, name: str, i: int) -> bool | None:
    # Only meaningful where a divergence row exists in both traces.
    return bool(c[name][i]) if 0 <= c["position"][i] < c["compared"][i] else None


@dataclass(frozen=True)
class PairResult:
    """One pair's verdict and evidence. None = unknown / not applicable."""

    key: str
    cls: str
    position: int | None
    token_a: int | None
    token_b: int | None
    gap_a: float | None  # nats: logprob_A(token_a) - logprob_A(token_b)
    gap_b: float | None  # nats: logprob_B(token_b) - logprob_B(token_a)
    gap_a_ulp: float | None  # the same gaps in BF16 ULPs of the raw logits
    gap_b_ulp: float | None
    boundary_a: int | None  # cached_tokens (reused-prefix boundary)
    boundary_b: int | None
    drift_max: float | None  # max |Δ chosen logprob| before the divergence (nats)
    drift_mean: float | None
    bitwise: bool  # chosen logprobs bitwise equal before the divergence
    topk_overlap: float | None  # share of A's top-k ids in B's top-k at the divergence
    vllm_close: bool | None  # check_logprobs_close's verdict
    len_a: int
    len_b: int
    rule: str
    teacher: str | None = None  # the --teacher-forced verdict
    b_in_topk_a: bool | None = None  # when False, gap_a is only a lower bound
    a_in_topk_b: bool | None = None

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "cls"}
        return {"key": d.pop("key"), "class": self.cls, **d}


def rule_text(c: Mapping[str, np.ndarray], i: int, thr: Thresholds) -> str:
    """Why pair i got its class, with the numbers that decided it."""
    cls = c["cls"][i]
    if cls == "incomparable":
        return c["incomparable"][i]
    dmax = c["drift_max"][i]
    drift = "no position before it" if not np.isfinite(dmax) else f"drift {dmax:.3g} nats"
    if cls == "identical":
        tail = "chosen logprobs bitwise equal" if c["bitwise"][i] else f"max {drift}"
        return f"same {c['compared'][i]} token ids; {tail}"
    t = c["position"][i]
    if cls == "post_eos":
        return f"A emitted EOS at {c['eos_pos'][i]} before the first difference at {t}"
    gaps = f"|gap| A {_gap(c, 'a', i)}, B {_gap(c, 'b', i)}"
    if cls == "bf16_tie_flip":
        return f"{gaps} <= tie ({thr.tie_ulps:g} ulp / {thr.tie_nats:g} nats); {drift} <= {thr.drift_nats:g}"
    if cls == "cache_boundary":
        return (
            f"boundaries {c['boundary_a'][i]} vs {c['boundary_b'][i]}; {gaps} <= drift tolerance "
            f"{thr.drift_nats:g}; {drift}"
        )
    return _unexplained_text(c, i, thr, gaps, drift)


def _gap(c, side: str, i: int) -> str:
    nats, ulp = c[f"gap_{side}"][i], c[f"gap_{side}_ulp"][i]
    other_in = c["b_in_topk_a" if side == "a" else "a_in_topk_b"][i]
    if not np.isfinite(nats):
        return "?"
    s = f"{abs(nats):.4g}" if other_in else f">={abs(nats):.4g}"
    return s + (f" nats ({abs(ulp):.3g} ulp)" if np.isfinite(ulp) else " nats")


def _unexplained_text(c, i: int, thr: Thresholds, gaps: str, drift: str) -> str:
    if c["position"][i] >= c["compared"][i]:
        return (
            f"length mismatch: {c['len_a'][i]} vs {c['len_b'][i]} tokens, identical up to "
            f"{c['compared'][i]}, no EOS before"
        )
    if np.isfinite(c["drift_max"][i]) and c["drift_max"][i] > thr.drift_nats:
        same = " with identical boundaries" if c["boundary_a"][i] == c["boundary_b"][i] else ""
        return f"{drift} > {thr.drift_nats:g} before the flip{same}"
    if not c["b_in_topk_a"][i]:
        return f"B's token {c['token_b'][i]} not in A's top-k; {gaps}"
    if not c["a_in_topk_b"][i]:
        return f"A's token {c['token_a'][i]} not in B's top-k; {gaps}"
    ba, bb = c["boundary_a"][i], c["boundary_b"][i]
    why = (
        f"beyond drift tolerance {thr.drift_nats:g}"
        if ba != bb and ba >= 0 and bb >= 0
        else f"boundaries {'equal' if ba == bb else 'unknown'} ({ba} vs {bb})"
    )
    return f"{gaps} beyond tie tolerance, {why}"


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

    def __len__(self) -> int:
        return len(self.columns["key"])

    def pair(self, i: int) -> PairResult:
        c = self.columns
        vc = int(c["vllm_close"][i])
        return PairResult(
            key=str(c["key"][i]),
            cls=str(c["cls"][i]),
            position=_i(c["position"][i]),
            token_a=_i(c["token_a"][i]),
            token_b=_i(c["token_b"][i]),
            gap_a=_f(c["gap_a"][i]),
            gap_b=_f(c["gap_b"][i]),
            gap_a_ulp=_f(c["gap_a_ulp"][i]),
            gap_b_ulp=_f(c["gap_b_ulp"][i]),
            boundary_a=_i(c["boundary_a"][i]),
            boundary_b=_i(c["boundary_b"][i]),
            drift_max=_f(c["drift_max"][i]),
            drift_mean=_f(c["drift_mean"][i]),
            bitwise=bool(c["bitwise"][i]),
            topk_overlap=_f(c["topk_overlap"][i]),
            vllm_close=None if vc < 0 else bool(vc),
            len_a=int(c["len_a"][i]),
            len_b=int(c["len_b"][i]),
            rule=str(c["rule"][i]),
            teacher=c["teacher"][i],
            b_in_topk_a=_flag(c, "b_in_topk_a", i),
            a_in_topk_b=_flag(c, "a_in_topk_b", i),
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

    @property
    def ok(self) -> bool:
        c = self.counts()
        return not any(c[name] for name in FAILING)

    def to_json(self) -> dict[str, Any]:
        s = self.counts()
        summary = {
            k: s[k]
            for k in (
                "pairs",
                "identical",
                "post_eos",
                "bf16_tie_flip",
                "cache_boundary",
                "unexplained",
                "incomparable",
            )
        }
        return {
            "schema": SCHEMA,
            "a": self.a,
            "b": self.b,
            "summary": summary,
            "thresholds": {
                "tie_ulps": self.thresholds.tie_ulps,
                "tie_nats": self.thresholds.tie_nats,
                "drift_nats": self.thresholds.drift_nats,
            },
            "eos_token_ids": list(self.eos_ids),
            "eos_source": self.eos_source,
            "notes": list(self.notes),
            "pairs": [p.to_json() for p in self.pairs],
        }
