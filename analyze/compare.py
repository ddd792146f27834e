"""`diff(a, b)`: read two traces, align them by key, classify every pair.

Nothing here prints; report.py formats a DiffResult. Readers opened here are
closed before returning (a DiffResult holds numbers only).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable

import numpy as np

from tracekit.errors import ConfigError
from tracekit.store import TraceReader

from .align import Side, align, load_side, parse_select
from .classify import Thresholds, classify
from .result import DiffResult, rule_text


def _open(stack: contextlib.ExitStack, t: str | os.PathLike | TraceReader) -> TraceReader:
    if isinstance(t, TraceReader):
        return t
    return stack.enter_context(TraceReader(t))


def eos_ids(a: Side, b: Side, extra: Iterable[int] = ()) -> tuple[tuple[int, ...], str]:
    """EOS ids and where they came from: run metadata and --eos; failing both,
    the last token of every finish_reason == "stop" row of either trace."""
    extra = tuple(int(x) for x in extra)
    ids = set(a.meta.eos_token_ids) | set(b.meta.eos_token_ids) | set(extra)
    if ids:
        src = "run metadata" if not extra else ("--eos" if ids == set(extra) else "run metadata + --eos")
        return tuple(sorted(ids)), src
    found: set[int] = set()
    for s in (a, b):
        t = s.table
        r = s.rows[(t.finish_reason[s.rows] == "stop") & (t.n_tokens[s.rows] > 0)]
        found |= set(s.token_id[t.token_offset[r] + t.n_tokens[r] - 1].tolist())
    if found:
        return tuple(sorted(found)), "inferred: last token of finish_reason=stop rows"
    return (), "none known (post_eos cannot fire; pass --eos)"


def _as_select(sel: str | dict | None) -> dict[str, str]:
    return parse_select(sel) if isinstance(sel, (str, type(None))) else dict(sel)


def diff(
    a: str | os.PathLike | TraceReader,
    b: str | os.PathLike | TraceReader,
    *,
    tie_ulps: float = Thresholds.tie_ulps,
    tie_nats: float = Thresholds.tie_nats,
    drift_nats: float = Thresholds.drift_nats,
    a_select: str | dict | None = None,
    b_select: str | dict | None = None,
    eos: Iterable[int] = (),
    teacher: str | os.PathLike | TraceReader | None = None,
) -> DiffResult:
    """Compare trace b with the reference a, request by request (paired by key).

    a_select/b_select pick rows of a teacher-forced trace ("history=full,dtype=fp32").
    teacher: a teacher-forced diagnostic trace; each divergent pair then says
    whether some cache history or dtype of it reproduces the flip (teacher.py).
    """
    thr = Thresholds(tie_ulps=tie_ulps, tie_nats=tie_nats, drift_nats=drift_nats)
    with contextlib.ExitStack() as stack:
        ra, rb = _open(stack, a), _open(stack, b)
        if os.path.abspath(ra.path) == os.path.abspath(rb.path) and not (a_select or b_select):
            raise ConfigError(
                f"A and B are the same file ({ra.path}); pass two traces "
                "(or --a-select/--b-select to compare rows of one teacher-forced file)"
            )
        side_a = load_side(ra, _as_select(a_select), "a")
        side_b = load_side(rb, _as_select(b_select), "b")
        ids, src = eos_ids(side_a, side_b, eos)
        al = align(side_a, side_b)
        cols = classify(al, thr, np.asarray(ids, dtype=np.int64))
        cols["rule"] = np.array([rule_text(cols, i, thr) for i in range(len(al.keys))], dtype=object)
        cols["teacher"] = np.full(len(al.keys), None, dtype=object)
        notes = []
        if teacher is not None:
            from .teacher import cross_check

            cols["teacher"] = cross_check(_open(stack, teacher), al, cols)
            notes.append("teacher-forced verdicts are a cross-check; the classes come from the HTTP traces")
        return DiffResult(ra.path, rb.path, thr, ids, src, cols, tuple(notes))
