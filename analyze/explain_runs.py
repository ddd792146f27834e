"""Scoring the runs of `tracekit explain`: each variant run of a pair, at its first
differing position t, against A's tokens (see `tracekit.analyze.explain` for the outcomes
and what makes a run numeric), and the teacher-forced top-1 at t."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tracekit.store import TraceReader
from tracekit.variants import ALONE, COLD, Variant


@dataclass
class VariantCount:
    """The runs of one (config, variant) for one pair."""

    config: str
    variant: str
    n: int = 0
    a: int = 0
    b: int = 0
    b_numeric: int = 0
    other: int = 0
    early: int = 0
    early_numeric: int = 0  # of `early`: left A's tokens at a near-tie (within the bounds), not by a jump
    failed: int = 0
    boundaries: Counter = field(default_factory=Counter)  # reported cached_tokens of the runs
    first_early: int | None = None
    worst: tuple[float, float] | None = None  # (drift, gap) of the least numeric B run
    gaps: list = field(default_factory=list)  # |logprob(A's token) - logprob(B's token)| at t, runs that reached t
    errs: list = field(default_factory=list)  # per run reaching t: mean weighted |Δlogprob| vs the FP32 reference

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("config", "variant", "n", "a", "b", "b_numeric", "other", "early", "failed")}
        d["early_numeric"] = self.early_numeric
        d["boundaries"] = {str(k): v for k, v in sorted(self.boundaries.items())}
        d["first_early"] = self.first_early
        d["worst_b_run"] = None if self.worst is None else {"drift_nats": self.worst[0], "gap_nats": self.worst[1]}
        d["reference_err_nats"] = None if not self.errs else float(np.mean(self.errs))
        return d

    @property
    def err(self) -> float | None:
        """Mean error of the runs against the FP32 reference (None without one)."""
        return float(np.mean(self.errs)) if self.errs else None


def _tag(params: str) -> dict | None:
    try:
        tag = json.loads(params).get("explain") if params else None
    except (ValueError, AttributeError):
        return None
    return tag if isinstance(tag, dict) else None


def _gap(ids: np.ndarray, lps: np.ndarray, a: int, b: int) -> float | None:
    """|logprob(a) - logprob(b)| in one top-k row, or None when either is missing."""
    where = {int(i): float(lp) for i, lp in zip(ids, lps) if i >= 0}
    if a not in where or b not in where:
        return None
    return abs(where[a] - where[b])


class Scorer:
    """Scores variant runs against one pair: A's tokens and logprobs up to t."""

    def __init__(
        self,
        pair: dict,
        a_ids: np.ndarray,
        a_lps: np.ndarray,
        drift_nats: float,
        mates: int = 0,
        gap_nats: float | None = None,
    ):
        self.p, self.t = pair, int(pair["position"])
        self.a_ids, self.a_lps, self.drift_nats = a_ids[: self.t], a_lps[: self.t], drift_nats
        # the bound on the A/B gap at t in a run that gave B's token (default: the drift bound)
        self.gap_nats = drift_nats if gap_nats is None else max(gap_nats, drift_nats)
        self.counts: dict[tuple[str, str], VariantCount] = {}
        self.mates = mates
        self.ref: tuple[np.ndarray, np.ndarray] | None = None  # FP32 reference top-k rows [<= t+1, k]

    def set_reference(self, ids: np.ndarray, lps: np.ndarray) -> None:
        self.ref = (ids[: self.t + 1], lps[: self.t + 1])

    def add(self, config: str, variant: str, status: str, cached: int, cols) -> None:
        vc = self.counts.setdefault((config, variant), VariantCount(config, variant))
        vc.n += 1
        vc.boundaries[int(cached)] += 1
        t = self.t
        if status != "ok" or cols is None or len(cols) <= t:
            vc.failed += 1
            return
        ids = cols.token_id
        d = np.flatnonzero(ids[:t] != self.a_ids)
        if len(d):
            d0 = int(d[0])
            vc.early += 1
            vc.first_early = d0 if vc.first_early is None else min(vc.first_early, d0)
            # another near-tie that tipped before t (a burst's other batch mates), or a jump
            g = _gap(cols.topk_id[d0], cols.topk_logprob[d0], int(self.a_ids[d0]), int(ids[d0]))
            if g is not None and g <= self.gap_nats and self._drift(cols, d0) <= self.drift_nats:
                vc.early_numeric += 1
            return
        tok = int(ids[t])
        if self.ref is not None:
            self._score_reference(vc, cols)
        gap = _gap(cols.topk_id[t], cols.topk_logprob[t], self.p["token_a"], self.p["token_b"])
        if gap is not None:
            vc.gaps.append(gap)
        if tok == self.p["token_a"]:
            vc.a += 1
        elif tok == self.p["token_b"]:
            vc.b += 1
            drift = self._drift(cols, t)
            g = float("inf") if gap is None else gap
            if drift <= self.drift_nats and g <= self.gap_nats:
                vc.b_numeric += 1
            elif vc.worst is None or max(drift, g) > max(vc.worst):
                vc.worst = (drift, g)
        else:
            vc.other += 1

    def _drift(self, cols, t: int) -> float:
        """Max |logprob - A's| over the chosen tokens before t (inf when a NaN is among them)."""
        with np.errstate(all="ignore"):
            diffs = np.abs(cols.logprob[:t].astype(np.float64) - self.a_lps[:t])
        if t and np.isnan(diffs).any():
            return float("inf")  # a NaN never hides drift
        return float(np.nanmax(diffs)) if t and np.isfinite(diffs).any() else 0.0

    def _score_reference(self, vc: VariantCount, cols) -> None:
        from .reference import row_errors

        ids, lps = self.ref
        n = min(len(ids), len(cols.topk_id))
        err, _ = row_errors(cols.topk_id[:n], cols.topk_logprob[:n], ids[:n], lps[:n])
        if np.isfinite(err).any():
            vc.errs.append(float(np.nanmean(err)))


def read_reference_rows(path: str, keys: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """key -> the FP32 `full` teacher-forced top-k rows (ids, logprobs) of a replay trace."""
    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            if t.key[i] in keys and t.history[i] == "full" and t.dtype[i] == "fp32" and t.status[i] == "ok":
                cols = r.tokens(i)
                out[t.key[i]] = (cols.topk_id, cols.topk_logprob)
    return out


def read_variants(paths: list[str], scorers: dict[str, Scorer]) -> list[str]:
    """Score every target row of the variant traces; returns notes (cache availability)."""
    notes = []
    for path in paths:
        with TraceReader(path) as r:
            ex = r.meta.record.explain
            flush = ex.get("cache_flush") or {}
            if flush and not flush.get("available"):
                notes.append(
                    f"{ex.get('config', '?')} ({r.meta.record.target}): cold variant unavailable: "
                    f"{flush.get('reason', '')}"
                )
            elif flush and not flush.get("flushes", True):  # cold by request, but no flush (llama.cpp)
                notes.append(
                    f"{ex.get('config', '?')} ({r.meta.record.target}): no prefix-cache flush before warm and "
                    f"burst runs: {flush.get('reason', '')}"
                )
            t = r.requests
            for i in range(len(t)):
                tag = _tag(t.params[i])
                if not tag or tag.get("role") != "target" or tag.get("target") not in scorers:
                    continue
                cols = r.tokens(i) if t.status[i] == "ok" else None
                scorers[tag["target"]].add(
                    tag.get("config", "engine"), tag["variant"], t.status[i], t.cached_tokens[i], cols
                )
    return notes


def read_teacher(path: str, pairs: dict[str, dict]) -> dict[str, dict[str, int]]:
    """key -> {"<history> <dtype>": top-1 id at the pair's position t} (largest raw logit,
    lowest id on an exact tie, as greedy engines choose)."""
    out: dict[str, dict[str, int]] = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            p = pairs.get(t.key[i])
            if p is None or t.status[i] != "ok" or int(t.n_tokens[i]) <= int(p["position"]):
                continue  # an engine replay whose history was not achieved is an error row: never read
            cols = r.tokens(i)
            pos = int(p["position"])
            ids = cols.topk_id[pos]
            score = cols.topk_logit[pos] if cols.topk_logit is not None else cols.topk_logprob[pos]
            ok = (ids >= 0) & np.isfinite(score)
            if not ok.any():
                continue
            best = np.max(score[ok])
            out.setdefault(t.key[i], {})[f"{t.history[i]} {t.dtype[i]}"] = int(np.min(ids[ok & (score == best)]))
    return out


def right_side(p: dict, teacher: dict[str, int], counts: dict) -> tuple[str, str | None]:
    """Which side agrees with the FP32 reference: the teacher-forced full fp32 argmax, else the
    majority token of the FP32 configuration's cold runs."""
    ref, what = teacher.get("full fp32"), "the FP32 full-history argmax (teacher-forced)"
    if ref is None:
        c = counts.get(("fp32", str(COLD))) or counts.get(("fp32", str(ALONE)))
        if c is not None and max(c.a, c.b) > c.n / 2:
            ref = p["token_a"] if c.a > c.b else p["token_b"]
            what = f"the FP32 configuration's alone runs ({max(c.a, c.b)}/{c.n})"
    if ref is None:
        return "unknown: no FP32 reference (give --teacher-forced MODEL_DIR or --fp32-url)", None
    if ref == p["token_a"]:
        return f"A agrees with {what} (token {ref}); B rounded away from it", "A"
    if ref == p["token_b"]:
        return f"B agrees with {what} (token {ref}); A rounded away from it", "B"
    return f"neither: {what} is token {ref}", "neither"


def config_lines(counts: dict) -> list[str]:
    """One line per other configuration (deterministic, fp32): the tokens its runs chose."""
    out = []
    for config, name in (("deterministic", "deterministic configuration"), ("fp32", "FP32 configuration")):
        cs = [c for (cfg, _), c in sorted(counts.items()) if cfg == config]
        if not cs:
            continue
        n, a, b = sum(c.n for c in cs), sum(c.a for c in cs), sum(c.b for c in cs)
        per = ", ".join(
            f"{c.variant} A {c.a}/{c.n} B {c.b}/{c.n}" + (f" early {c.early}" if c.early else "") for c in cs
        )
        line = f"{name}: A's token in {a}/{n} runs, B's in {b}/{n} ({per})"
        if config == "deterministic":
            line += " — STILL FLIPS: not batch-variant numerics" if a and b else " — one token whatever the batch"
        out.append(line)
    return out


def where(b: int) -> str:
    return "0 (cold)" if b == 0 else str(b)


def ran_at(c: VariantCount | None, b: int) -> bool:
    """No run of c reported reusing other than b tokens: the condition asked was achieved, or the
    engine does not report it (-1: nothing refutes it)."""
    return c is not None and set(c.boundaries) <= {b, -1}


def ran(c: VariantCount) -> str:
    """The reused prefixes c's runs reported: "34 (3x), 123 (2x)"."""
    return ", ".join(f"{k} ({v}x)" for k, v in sorted(c.boundaries.items()))


def alone_at(c: VariantCount, b: int) -> str:
    """Where the alone runs ran: "at the same boundary 123", or what they reused instead."""
    if ran_at(c, b):
        return f"at the same boundary {where(b)}"
    return f"(asked at boundary {where(b)}; the runs reused {ran(c)})"


def side_variant(counts: dict, config: str, b: int) -> VariantCount | None:
    """The alone run at boundary b: warm:b, or the cold run for b == 0."""
    v = Variant.alone_at(b)
    return None if v is None else counts.get((config, str(v)))


def engine_history(boundary: int, dtype: str) -> str:
    """The engine-side replay's row label at a side's boundary (0 or unknown: cold)."""
    return f"engine:warm:{boundary} {dtype}" if boundary > 0 else f"engine:cold {dtype}"
