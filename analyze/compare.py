"""`diff(a, b)`: read two traces, align them by key, classify every pair.

Nothing here prints; report.py formats a DiffResult. Readers opened here are
closed before returning (a DiffResult holds numbers only). This is also where
the facts a verdict depends on are gathered, each with its source: the EOS ids
(never guessed) and each trace's dtype (the grid its distances are counted on).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable

import numpy as np

from tracekit.errors import ConfigError
from tracekit.store import TraceReader, read_token_rows

from .align import Side, align, drift_values, load_side, parse_select
from .classify import Thresholds, classify
from .grid import Grid, normalise, on_grid, resolve_dtype
from .result import DiffResult, rule_text

EOS_UNKNOWN = (
    "unknown: post_eos cannot fire; pass --eos ID or --tokenizer DIR (a model directory with "
    "generation_config.json or tokenizer_config.json)"
)


def _open(stack: contextlib.ExitStack, t: str | os.PathLike | TraceReader) -> TraceReader:
    if isinstance(t, TraceReader):
        return t
    return stack.enter_context(TraceReader(t))


def eos_ids(a: Side, b: Side, extra: Iterable[int] = (), tokenizer: str | None = None) -> tuple[tuple[int, ...], str]:
    """EOS ids and where they came from: the run metadata (the engine's
    self-report or the model's files at capture), --eos, --tokenizer DIR, and
    failing all of these the model directory the run names when it exists here.
    Never inferred from the streams (a stop string is not an EOS)."""
    from tracekit.modelinfo import eos_token_ids

    found: list[tuple[str, set[int]]] = [
        ("A's run metadata", set(a.meta.eos_token_ids)),
        ("B's run metadata", set(b.meta.eos_token_ids)),
        ("--eos", {int(x) for x in extra}),
    ]
    if tokenizer:
        d = os.path.dirname(tokenizer) if os.path.isfile(tokenizer) else tokenizer  # a tokenizer.json: its dir
        found.append((f"--tokenizer {tokenizer}", set(eos_token_ids(d or "."))))
    if not any(ids for _, ids in found):
        for side in (a, b):
            for k in ("tokenizer", "model_dir"):
                d = side.meta.run.get(k)
                if isinstance(d, str) and d and os.path.isdir(d):
                    found.append((f"model files at {d} (named by the run metadata)", set(eos_token_ids(d))))
                    break
    ids = set().union(*(s for _, s in found))
    if not ids:
        return (), EOS_UNKNOWN
    return tuple(sorted(ids)), " + ".join(dict.fromkeys(src for src, s in found if s))


def _inferred_grid(side: Side) -> Grid | None:
    """With no dtype in the metadata but raw logits stored: the finest of BF16 /
    FP16 / FP32 whose grid holds every sampled logit (the first 256 token rows)."""
    r = side.reader
    n = min(256, r.n_token_rows)
    if not r.has_column("topk_logit") or not n:
        return None
    x = read_token_rows(r, "topk_logit", np.arange(n)).ravel()
    x = x[np.isfinite(x) & (x != 0)]
    if not len(x):
        return None
    for d, bits in (("bf16", 7), ("fp16", 10)):
        if on_grid(x, bits).all():
            return Grid(d, f"inferred: {len(x)} sampled raw logits all lie on the {d.upper()} grid", False)
    return Grid("fp32", "inferred: the raw logits are not on the BF16 or FP16 grid", False)


def side_dtypes(side: Side, rows: np.ndarray, override: str | None, label: str) -> tuple[np.ndarray, Grid, list[str]]:
    """Per pair [P] the dtype name this side is judged on, the side's grid, notes.
    A teacher-forced row's own `dtype` wins over the run's (one file holds several)."""
    grid, conflict = resolve_dtype(side.meta.run, override)
    notes = [f"{label}: {conflict}"] if conflict else []
    if not grid.known:
        grid = _inferred_grid(side) or grid
    per_row = np.full(len(rows), grid.dtype, dtype=object)
    if not override:
        col = side.table.dtype
        for i, r in enumerate(rows.tolist()):
            d = normalise(col[r]) if r >= 0 else None
            if d:
                per_row[i] = d
    row_named = bool(len(rows)) and not override and (per_row != grid.dtype).any()
    if not grid.known and not row_named:
        notes.append(
            f"{label}: dtype {grid.dtype} ({grid.source}); distances are counted on that grid. "
            "Pass --dtype (or record dtype in the run metadata) if it is wrong: an FP32 run judged "
            "on the BF16 grid can hide a bug"
        )
    return per_row, grid, notes


def _as_select(sel: str | dict | None) -> dict[str, str]:
    return parse_select(sel) if isinstance(sel, (str, type(None))) else dict(sel)


def diff(
    a: str | os.PathLike | TraceReader,
    b: str | os.PathLike | TraceReader,
    *,
    thresholds: Thresholds | None = None,
    a_select: str | dict | None = None,
    b_select: str | dict | None = None,
    eos: Iterable[int] = (),
    tokenizer: str | None = None,
    dtype: str | None = None,
    teacher: str | os.PathLike | TraceReader | None = None,
    **tolerances: float | None,
) -> DiffResult:
    """Compare trace b with the reference a, request by request (paired by key).

    Tolerances: `thresholds`, or keywords of Thresholds (tie_ulps=, drift_nats=, ...);
    unset ones take the per-dtype defaults. a_select/b_select pick rows of a
    teacher-forced trace ("history=full,dtype=fp32"). eos / tokenizer: EOS ids and a
    model directory to read them from. dtype: judge both traces on this grid instead
    of the one their metadata names. teacher: a teacher-forced diagnostic trace; each
    divergent pair then says whether some cache history or dtype of it reproduces
    the flip (teacher.py).
    """
    if thresholds is not None and tolerances:
        raise ConfigError("pass either thresholds= or tolerance keywords, not both")
    thr = thresholds or Thresholds(**tolerances)
    with contextlib.ExitStack() as stack:
        ra, rb = _open(stack, a), _open(stack, b)
        if os.path.abspath(ra.path) == os.path.abspath(rb.path) and not (a_select or b_select):
            raise ConfigError(
                f"A and B are the same file ({ra.path}); pass two traces "
                "(or --a-select/--b-select to compare rows of one teacher-forced file)"
            )
        side_a = load_side(ra, _as_select(a_select), "a")
        side_b = load_side(rb, _as_select(b_select), "b")
        ids, src = eos_ids(side_a, side_b, eos, tokenizer)
        side_a, side_b, drift_note = drift_values(side_a, side_b)
        al = align(side_a, side_b)
        dt_a, grid_a, notes_a = side_dtypes(side_a, al.row_a, dtype, "A")
        dt_b, grid_b, notes_b = side_dtypes(side_b, al.row_b, dtype, "B")
        cols = classify(al, thr, np.asarray(ids, dtype=np.int64), (dt_a, dt_b))
        cols["rule"] = np.array([rule_text(cols, i) for i in range(len(al.keys))], dtype=object)
        cols["teacher"] = np.full(len(al.keys), None, dtype=object)
        notes = [n for n in (side_a.note, side_b.note, drift_note) if n] + notes_a + notes_b
        if not ids:
            notes.append(f"EOS ids {EOS_UNKNOWN}")
        if teacher is not None:
            from .teacher import cross_check

            cols["teacher"] = cross_check(_open(stack, teacher), al, cols)
            notes.append("teacher-forced verdicts are a cross-check; the classes come from the HTTP traces")
        grids = {"a": grid_a, "b": grid_b}
        return DiffResult(ra.path, rb.path, thr, ids, src, cols, tuple(notes), grids)
