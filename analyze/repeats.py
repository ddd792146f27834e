"""Reproducibility statistics over repeats of the same prompts (`tracekit stats`).

A capture with `--repeat K` sends each prompt K times (keys `id#r<k>`). Greedy
decoding on a batch-invariant engine would give K identical completions; a
real engine gives a few distinct ones, and how early they split and at which
top-2 gaps says how fragile the run is. Per prompt:

- the completions (ok rows; token id sequences, lengths included) and how many
  are distinct;
- a reference completion: the most common one (ties: the one seen first), or
  repeat 0 (`reference="r0"`);
- each completion's first-divergence position against the reference (0-based
  generated-token index; a completion equal to the reference has none);
- the flip rate by top-2 gap: at every position t a completion reaches with
  the reference's prefix it is one trial, and a flip when it picks another
  token there. Trials are binned by the reference's top-2 gap at t, in nats
  (logprobs) and, with raw logits, in steps of the run's grid
  (`tracekit.analyze.grid`). flips / trials per bin estimates P(flip | gap).

Headline, after Thinking Machines' "1000 completions -> 80 unique, first split
at token 103": `1600 completions of 8 prompts -> 23 unique, first split at
token 5`. Pure numpy over the stored columns; tables and the PNG are in
`analyze/repeats_report.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracekit.errors import ConfigError
from tracekit.store import TraceReader

from .grid import pair_grids, steps

REFERENCES = ("mode", "r0")
REPEAT_RE = re.compile(r"^(?P<prompt>.+)#r(?P<rep>\d+)$")
# Upper edges of the top-2 gap's bins, after the exact tie: (0, e0], (e0, e1], ..., (e_n-1, inf).
NATS_EDGES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, np.inf)
STEP_EDGES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, np.inf)


def split_key(key: str) -> tuple[str, int]:
    """'p017#r12' -> ('p017', 12); a key without a repeat suffix is repeat 0 of itself."""
    m = REPEAT_RE.match(key)
    return (m["prompt"], int(m["rep"])) if m else (key, 0)


@dataclass(frozen=True)
class PromptStats:
    prompt: str
    completions: int
    unique: int
    reference: str  # key of the reference completion
    reference_count: int  # completions equal to the reference
    first_split: int | None  # earliest first-divergence position (None: all equal the reference)
    split_positions: tuple[int, ...]  # first-divergence position of each completion that differs

    def as_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "completions": self.completions,
            "unique": self.unique,
            "reference": self.reference,
            "reference_count": self.reference_count,
            "first_split": self.first_split,
            "split_positions": list(self.split_positions),
        }


@dataclass(frozen=True)
class GapCurve:
    """Trials and flips binned by the reference's top-2 gap: bin 0 is the exact tie (gap 0),
    then (0, edges[0]], (edges[0], edges[1]], ...; len(edges) + 1 bins in all."""

    unit: str  # "nats" | "steps of the bf16 grid" ...
    edges: tuple[float, ...]
    trials: tuple[int, ...]
    flips: tuple[int, ...]

    @property
    def rate(self) -> np.ndarray:
        t = np.asarray(self.trials, dtype=np.float64)
        return np.where(t > 0, np.asarray(self.flips) / np.maximum(t, 1), np.nan)

    def bin_labels(self) -> list[str]:
        e = (0.0,) + tuple(self.edges)
        out = ["0 (exact tie)"]
        for lo, hi in zip(e[:-1], e[1:]):
            out.append(f"> {lo:g}" if np.isinf(hi) else f"({lo:g}, {hi:g}]")
        return out

    def as_dict(self) -> dict:
        return {
            "unit": self.unit,
            "bins": self.bin_labels(),
            "trials": list(self.trials),
            "flips": list(self.flips),
            "flip_rate": [None if np.isnan(r) else round(float(r), 6) for r in self.rate],
        }


@dataclass(frozen=True)
class StatsResult:
    paths: tuple[str, ...]
    reference: str  # "mode" | "r0"
    prompts: tuple[PromptStats, ...]
    gap_nats: GapCurve
    gap_steps: GapCurve | None  # None without raw logits
    skipped_rows: int  # rows not ok (failed, cancelled, timeout)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def completions(self) -> int:
        return sum(p.completions for p in self.prompts)

    @property
    def unique(self) -> int:
        return sum(p.unique for p in self.prompts)

    @property
    def split_positions(self) -> np.ndarray:
        return np.asarray([s for p in self.prompts for s in p.split_positions], dtype=np.int64)

    @property
    def first_split(self) -> int | None:
        firsts = [p.first_split for p in self.prompts if p.first_split is not None]
        return min(firsts) if firsts else None

    @property
    def ok(self) -> bool:
        """Reproducible: every prompt gave one completion."""
        return all(p.unique == 1 for p in self.prompts)

    def headline(self) -> str:
        n, p = self.completions, len(self.prompts)
        what = f"{n} completions" + (f" of {p} prompts" if p > 1 else "")
        if self.first_split is None:
            return f"{what} → {self.unique} unique, no split"
        firsts = [q.first_split for q in self.prompts if q.first_split is not None]
        more = ""
        if len(self.prompts) > 1:
            more = f" (median first split {float(np.median(firsts)):g} over the {len(firsts)} prompts that split)"
        return f"{what} → {self.unique} unique, first split at token {self.first_split}{more}"

    def to_json(self) -> dict:
        pos = self.split_positions
        return {
            "schema": "tracekit.percentiles/1",
            "paths": list(self.paths),
            "headline": self.headline(),
            "reference": self.reference,
            "position_base": 0,
            "completions": self.completions,
            "unique": self.unique,
            "prompts_total": len(self.prompts),
            "prompts_split": sum(p.first_split is not None for p in self.prompts),
            "first_split": self.first_split,
            "split_positions": {
                "n": int(len(pos)),
                "histogram": {str(int(k)): int(v) for k, v in zip(*np.unique(pos, return_counts=True))},
            },
            "flip_rate_by_gap_nats": self.gap_nats.as_dict(),
            "flip_rate_by_gap_steps": None if self.gap_steps is None else self.gap_steps.as_dict(),
            "skipped_rows": self.skipped_rows,
            "notes": list(self.notes),
            "per_prompt": [p.as_dict() for p in self.prompts],
        }


@dataclass
class _Group:
    """One prompt's completions, in the order read."""

    keys: list = field(default_factory=list)
    reps: list = field(default_factory=list)
    ids: list = field(default_factory=list)  # [L] int32 each
    gap_nats: list = field(default_factory=list)  # [L] float64 each: top-1 minus top-2 logprob
    gap_steps: list = field(default_factory=list)  # [L] or None each


def _top2_gaps(r: TraceReader, bits: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per token row: top-1 minus top-2 logprob (nats), and with raw logits the same in grid steps."""
    n = r.n_token_rows
    if r.layout.topk < 2:
        raise ConfigError(f"{r.path}: top-k width {r.layout.topk}; the gap needs >= 2 (capture with --top-logprobs 2+)")
    lp = r.column("topk_logprob", slice(0, n))[:, :2].astype(np.float64)
    nats = lp[:, 0] - lp[:, 1]
    if bits is None or not r.layout.raw_logits:
        return nats, None
    lg = r.column("topk_logit", slice(0, n)).astype(np.float64)
    with np.errstate(all="ignore"):
        scale = np.nanmax(np.abs(lg), axis=1)  # the row's magnitude floors the grid (tracekit.analyze.grid)
    return nats, np.abs(steps(lg[:, 0], lg[:, 1], bits, scale))


def _read(paths: list[str]) -> tuple[dict[str, _Group], int, list[str], bool]:
    groups: dict[str, _Group] = {}
    skipped, notes, have_steps = 0, [], True
    for path in paths:
        with TraceReader(path) as r:
            t = r.requests
            g = pair_grids(r.meta.record)  # one trace alone: its own grid
            grid = g.a
            notes.extend(f"{path}: {n}" for n in g.notes[0])
            if not grid.known:
                notes.append(f"{path}: {grid.describe()}")
            nats, stp = _top2_gaps(r, grid.bits)
            have_steps &= stp is not None
            ids_all = r.column("token_id", slice(0, r.n_token_rows))
            for i in range(len(t)):
                if t.status[i] != "ok":
                    skipped += 1
                    continue
                prompt, rep = split_key(t.key[i])
                s, e = int(t.token_offset[i]), int(t.token_offset[i] + t.n_tokens[i])
                g = groups.setdefault(prompt, _Group())
                g.keys.append(t.key[i])
                g.reps.append(rep)
                g.ids.append(ids_all[s:e])
                g.gap_nats.append(nats[s:e])
                g.gap_steps.append(None if stp is None else stp[s:e])
    return groups, skipped, notes, have_steps


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First position where two id sequences differ (the shorter length when one is a prefix
    of the other); None when equal."""
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n] != b[:n])
    if len(d):
        return int(d[0])
    return None if len(a) == len(b) else n


def _reference(g: _Group, how: str) -> int:
    if how == "r0":
        return g.reps.index(min(g.reps))
    seen: dict[bytes, list[int]] = {}
    for i, ids in enumerate(g.ids):
        seen.setdefault(ids.tobytes() + len(ids).to_bytes(4, "little"), []).append(i)
    best = max(seen.values(), key=lambda idx: (len(idx), -idx[0]))
    return best[0]


def _prompt_stats(prompt: str, g: _Group, how: str, curves: dict, have_steps: bool) -> PromptStats:
    ref = _reference(g, how)
    rid = g.ids[ref]
    L = len(rid)
    unique = len({ids.tobytes() + len(ids).to_bytes(4, "little") for ids in g.ids})
    divs = [first_divergence(rid, ids) for ids in g.ids]
    # Trials: completion c reaches position t (< L) with the reference's prefix when
    # its divergence d_c >= t (or it has none); a flip at t when d_c == t and both
    # sides have a token there (a shorter completion that just ended did not flip).
    reach = np.zeros(L + 1, dtype=np.int64)
    flips = np.zeros(L, dtype=np.int64)
    for d, ids in zip(divs, g.ids):
        end = L if d is None else min(d, L)
        reach[0] += 1
        reach[end] -= 1  # positions [0, end) are non-flip trials
        if d is not None and d < min(L, len(ids)):
            flips[d] += 1
    trials = np.cumsum(reach)[:L] + flips  # a flip position is a trial too
    for unit, gaps in (("nats", g.gap_nats[ref]), ("steps", g.gap_steps[ref] if have_steps else None)):
        if gaps is None:
            continue
        edges = np.asarray((0.0,) + (NATS_EDGES if unit == "nats" else STEP_EDGES))
        nb = len(edges)  # bin 0: exact tie; bin i >= 1: (edges[i-1], edges[i]]
        b = np.where(gaps <= 0, 0, np.minimum(np.searchsorted(edges, gaps, side="left"), nb - 1))
        b = np.where(np.isnan(gaps), nb - 1, b)  # an unknown gap counts as wide
        curves[unit][0] += np.bincount(b, weights=trials, minlength=nb).astype(np.int64)
        curves[unit][1] += np.bincount(b, weights=flips, minlength=nb).astype(np.int64)
    split = sorted(d for d in divs if d is not None)
    return PromptStats(
        prompt=prompt,
        completions=len(g.ids),
        unique=unique,
        reference=g.keys[ref],
        reference_count=sum(d is None for d in divs),
        first_split=split[0] if split else None,
        split_positions=tuple(split),
    )


def reproducibility(paths: list[str | Path], reference: str = "mode") -> StatsResult:
    """Statistics over the repeats in one or more traces (rows of one prompt pooled across files)."""
    if reference not in REFERENCES:
        raise ConfigError(f"--reference {reference!r}: expected one of {', '.join(REFERENCES)}")
    paths = [str(p) for p in paths]
    groups, skipped, notes, have_steps = _read(paths)
    if not groups:
        raise ConfigError(f"{', '.join(paths)}: no ok request to compare")
    if all(len(g.ids) == 1 for g in groups.values()):
        notes.append("every prompt has one completion: capture with --repeat K (K >= 2) to measure reproducibility")
    curves = {
        "nats": [np.zeros(len(NATS_EDGES) + 1, np.int64), np.zeros(len(NATS_EDGES) + 1, np.int64)],
        "steps": [np.zeros(len(STEP_EDGES) + 1, np.int64), np.zeros(len(STEP_EDGES) + 1, np.int64)],
    }
    prompts = tuple(_prompt_stats(p, g, reference, curves, have_steps) for p, g in groups.items())
    with TraceReader(paths[0]) as r:
        grid = pair_grids(r.meta.record).a
    return StatsResult(
        paths=tuple(paths),
        reference=reference,
        prompts=prompts,
        gap_nats=GapCurve("nats", NATS_EDGES, tuple(map(int, curves["nats"][0])), tuple(map(int, curves["nats"][1]))),
        gap_steps=GapCurve(
            f"steps of the {grid.dtype} grid",
            STEP_EDGES,
            tuple(map(int, curves["steps"][0])),
            tuple(map(int, curves["steps"][1])),
        )
        if have_steps
        else None,
        skipped_rows=skipped,
        notes=tuple(notes),
    )


def run_groups(root: str | Path) -> list[tuple[str, list[str]]]:
    """(group id, [its serial baseline, each of its cells' bursts]) of a `tracekit run` directory
    (a merged one too), in run order: one engine configuration and prompt set per group, so its
    traces are repeats of the same prompts (serially and at each concurrency). Groups whose
    captures did not run are left out."""
    from tracekit.rundir import RunDir

    rd = RunDir(root)
    out: dict[str, list[str]] = {}
    for c in rd.load()[1]:
        r = c.record
        if r.baseline is None or r.burst is None:
            continue
        paths = out.setdefault(r.cell.group_id, [str(rd.path(r.baseline))])
        paths.append(str(rd.path(r.burst)))
    if not out:
        raise ConfigError(f"{rd.root}: no cell with both captures to compare")
    return list(out.items())
