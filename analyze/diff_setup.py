"""A diff's run-level facts of each side, besides its pairs: the grid its distances are
counted on (the run record, checked against a sample of the raw logits it holds), the dtype
each pair is judged on, and what the trace is (its label). compare.diff gathers them once,
whether it reads the pairs whole or a chunk at a time (stream.py).
"""

from __future__ import annotations

import numpy as np

from tracekit.dtypes import DTYPES
from tracekit.store import read_token_rows

from .grid import Grid, PairGrids, normalise, pair_grids
from .sides import Side


def _sampled_logits(side: Side) -> np.ndarray:
    """Finite non-zero raw logits of the first 256 token rows (empty without logits)."""
    r = side.reader
    n = min(256, r.n_token_rows)
    if not r.has_column("topk_logit") or not n:
        return np.zeros(0)
    x = read_token_rows(r, "topk_logit", np.arange(n)).ravel()
    return x[np.isfinite(x) & (x != 0)]


def grids(a: Side, b: Side, override: str | None) -> tuple[Grid, Grid, list[str], list[str]]:
    """The pair's grids (grid.pair_grids: the run records, checked against a sample of the raw
    logits each trace holds; each divergence row is checked again in classify), labelled notes."""
    logits = (None, None) if override else (_sampled_logits(a), _sampled_logits(b))
    g: PairGrids = pair_grids(a.meta.record, b.meta.record, override, logits)
    return g.a, g.b, [f"A: {n}" for n in g.notes[0]], [f"B: {n}" for n in g.notes[1]]


def side_dtypes(
    side: Side, rows: np.ndarray, grid: Grid, override: str | None, label: str
) -> tuple[np.ndarray, list[str]]:
    """Per pair [P] the dtype name this side is judged on. A teacher-forced row's own
    `dtype` is its configuration (one file holds several); an HTTP row's `dtype`
    that disagrees with the run is a conflict, judged on the finer grid."""
    per_row = np.full(len(rows), grid.dtype, dtype=object)
    notes: list[str] = []
    if override:
        return per_row, notes
    col = side.table.dtype
    tf = side.meta.source == "teacher_forced"
    named = (
        np.where(rows >= 0, np.asarray(col, dtype=object)[np.maximum(rows, 0)], "")
        if len(col)
        else np.full(len(rows), "", object)
    )
    for value in dict.fromkeys(named.tolist()):  # each distinct name once, in the order of the pairs
        d = normalise(value) if value else None
        if not d or d == grid.dtype:
            continue
        if tf or DTYPES[d].mantissa_bits > grid.bits:
            per_row[named == value] = d
        if not tf and not notes:
            notes.append(f"{label}: request rows name dtype {d}, the run {grid.dtype}: judged on the finer grid")
    return per_row, notes


def run_label(side: Side) -> str:
    """What a trace is, from its run metadata: 'vllm · bf16 · concurrency 8 · cache on · burst'."""
    rec = side.meta.record
    cache = rec.cache.setting
    parts = [
        str(rec.engine_name or side.meta.source),
        str(rec.dtype.value or ""),
        f"concurrency {rec.concurrency}" if rec.concurrency else "",
        f"cache {cache}" if cache and cache != "unknown" else "",
        str(rec.mode or ""),
    ]
    return " · ".join(p for p in parts if p)
