"""Drill-down for one request: the tokens around its divergence, side by side,
with top-k ids, decoded text, logprobs, raw logits and their distance to the
top-1 in steps of the trace's own grid (grid.py: the dtype from the run
metadata, or the row's). Reads only that request's rows. `tracekit show` prints it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import numpy as np
from tabulate import tabulate

from tracekit.dtypes import DTYPES
from tracekit.errors import ConfigError
from tracekit.schema import TokenColumns
from tracekit.store import TraceReader

from .align import parse_select, top1
from .grid import normalise, pair_grids, steps


def _row_of(r: TraceReader, key: str, select: str | None) -> int:
    t = r.requests
    keep = t.key == key
    for name, value in parse_select(select).items():
        keep &= getattr(t, name) == value
    hits = np.flatnonzero(keep)
    if not len(hits):
        near = ", ".join(sorted(set(t.key.tolist()))[:5])
        raise ConfigError(
            f"{r.path}: no request with key {key!r}{' matching the selection' if select else ''} (keys include: {near})"
        )
    if len(hits) > 1 and r.meta.source == "teacher_forced":
        combos = "; ".join(f"history={t.history[i]},dtype={t.dtype[i]}" for i in hits)
        raise ConfigError(
            f"{r.path}: key {key!r} has several teacher-forced rows ({combos}); pick one with --a-select/--b-select"
        )
    return int(hits[-1])


def _tokens(r: TraceReader, i: int) -> TokenColumns:
    """A request's columns; in a teacher-forced trace the token shown is the
    history's top-1 (as `diff` compares it), not the replayed token."""
    tok = r.tokens(i)
    if r.meta.source != "teacher_forced":
        return tok
    ids, lps = top1(tok.topk_id, tok.topk_logprob, tok.topk_logit)
    return TokenColumns(ids, lps, tok.t_arrival_s, tok.topk_id, tok.topk_logprob, tok.topk_logit)


def _candidates(tok: TokenColumns, t: int, k: int, decode, bits: int) -> list[dict[str, Any]]:
    """Top-k at position t: id, text, logprob, raw logit, steps below the top-1 on the grid."""
    ids, lps = tok.topk_id[t], tok.topk_logprob[t]
    lgs = tok.topk_logit[t].astype(np.float64) if tok.topk_logit is not None else np.full(len(ids), np.nan)
    out = []
    top_logit = np.nanmax(lgs) if np.isfinite(lgs).any() else np.nan
    for j in range(min(k, len(ids))):
        if ids[j] < 0:
            break
        ulp = steps(top_logit, lgs[j], bits, max(abs(top_logit), abs(lgs[j]))) if np.isfinite(lgs[j]) else None
        out.append(
            {
                "id": int(ids[j]),
                "text": decode(int(ids[j])) if decode else None,
                "logprob": _f(lps[j]),
                "logit": _f(lgs[j]),
                "ulp_from_top1": _f(ulp),  # steps of the side's grid (dtype below)
            }
        )
    return out


def _f(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def first_difference(a: TokenColumns, b: TokenColumns) -> int | None:
    n = min(len(a), len(b))
    mism = np.flatnonzero(a.token_id[:n] != b.token_id[:n])
    if len(mism):
        return int(mism[0])
    return n if len(a) != len(b) else None


def first_divergent_key(a_path: str, b_path: str, a_select: str | None = None, b_select: str | None = None) -> str:
    """The first key, in A's order, whose token ids differ between A and B (`show --first-divergent`:
    a tour's example must show a flip, not whichever key happens to come first)."""
    with TraceReader(a_path) as ra, TraceReader(b_path) as rb:
        keys_b = set(rb.requests.key.tolist())
        for key in dict.fromkeys(ra.requests.key.tolist()):
            if key not in keys_b:
                continue
            try:
                ta, tb = _tokens(ra, _row_of(ra, key, a_select)), _tokens(rb, _row_of(rb, key, b_select))
            except ConfigError:  # not in the selection
                continue
            if first_difference(ta, tb) is not None:
                return str(key)
    raise ConfigError(f"{a_path} vs {b_path}: no key diverges (every common key has the same token ids)")


def drill(
    a_path: str,
    b_path: str | None,
    key: str,
    position: int | None = None,
    context: int = 5,
    topk: int = 5,
    decode: Callable[[int], str] | None = None,
    a_select: str | None = None,
    b_select: str | None = None,
) -> dict[str, Any]:
    """The data `tracekit show` prints, as JSON-able data (schema tracekit.show/1)."""
    with contextlib.ExitStack() as stack:
        ra = stack.enter_context(TraceReader(a_path))
        rb = stack.enter_context(TraceReader(b_path)) if b_path else None
        ia = _row_of(ra, key, a_select)
        ta = _tokens(ra, ia)
        tb = _tokens(rb, _row_of(rb, key, b_select)) if rb else None
        div = first_difference(ta, tb) if tb is not None else None
        t0 = position if position is not None else (div if div is not None else 0)
        n = max(len(ta), len(tb) if tb is not None else 0)
        if not 0 <= t0 < max(n, 1):
            raise ConfigError(f"--position {t0} is outside the request ({n} positions)")
        lo, hi = max(0, t0 - context), min(n, t0 + context + 1)
        rows = [_position(t, ta, tb, decode) for t in range(lo, hi)]
        sides = {"a": _side(ra, ia, ta, t0, topk, decode)}
        if tb is not None:
            sides["b"] = _side(rb, _row_of(rb, key, b_select), tb, t0, topk, decode)
        return {"schema": "tracekit.show/2", "key": key, "position": t0, "first_difference": div, "rows": rows, **sides}


def _side(r: TraceReader, i: int, tok: TokenColumns, t0: int, topk: int, decode) -> dict[str, Any]:
    rec = r.record(i)
    grid = pair_grids(r.meta.record).a  # each side on its own grid, as recorded (no logit sample)
    dtype = normalise(rec.dtype) or grid.dtype
    source = "the row's dtype" if normalise(rec.dtype) else grid.source
    return {
        "file": r.path,
        "length": len(tok),
        "finish_reason": rec.finish_reason,
        "cached_tokens": rec.cached_tokens if rec.cached_tokens >= 0 else None,
        "history": rec.history or None,
        "dtype": rec.dtype or None,
        "grid": {"dtype": dtype, "source": source},
        "topk_at_position": _candidates(tok, t0, topk, decode, DTYPES[dtype].mantissa_bits) if t0 < len(tok) else [],
    }


def _position(t: int, ta: TokenColumns, tb: TokenColumns | None, decode) -> dict[str, Any]:
    def one(tok):
        if tok is None or t >= len(tok):
            return None
        i = int(tok.token_id[t])
        return {"id": i, "text": decode(i) if decode else None, "logprob": _f(tok.logprob[t])}

    a, b = one(ta), one(tb)
    same = a is not None and b is not None and a["id"] == b["id"]
    dlp = _f(a["logprob"] - b["logprob"]) if same and a["logprob"] is not None and b["logprob"] is not None else None
    return {"position": t, "a": a, "b": b, "same": same, "delta_logprob": dlp}


def render(d: dict[str, Any]) -> str:
    """Plain text: a header, the tokens around the position, the top-k of each side there."""

    def tok(x):
        return "" if x is None else (f"{x['id']} {x['text']!r}" if x["text"] is not None else str(x["id"]))

    def lp(x):
        return "" if x is None or x["logprob"] is None else f"{x['logprob']:.4f}"

    head = ["", "pos", "A token", "A logprob"] + (["B token", "B logprob", "Δ logprob"] if "b" in d else [])
    body = []
    for r in d["rows"]:
        mark = ">>" if r["position"] == d["position"] else ("!=" if "b" in d and not r["same"] else "")
        row = [mark, r["position"], tok(r["a"]), lp(r["a"])]
        if "b" in d:
            row += [tok(r["b"]), lp(r["b"]), "" if r["delta_logprob"] is None else f"{r['delta_logprob']:+.3g}"]
        body.append(row)
    fd = d["first_difference"]
    lines = [
        f"key {d['key']}  position {d['position']}"
        + ("" if "b" not in d else f"  (first difference: {'none' if fd is None else fd})")
    ]
    for name in ("a", "b"):
        if name in d:
            s = d[name]
            lines.append(
                f"{name.upper()}: {s['file']}  length {s['length']}  finish {s['finish_reason'] or '?'}  "
                f"cached_tokens {s['cached_tokens'] if s['cached_tokens'] is not None else '?'}"
                + (f"  history {s['history']} {s['dtype'] or ''}" if s["history"] else "")
                + f"  grid {s['grid']['dtype']} ({s['grid']['source']})"
            )
    lines += ["", tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)]
    for name in ("a", "b"):
        if name in d and d[name]["topk_at_position"]:
            cand = [
                [
                    j + 1,
                    c["id"],
                    "" if c["text"] is None else repr(c["text"]),
                    _n(c["logprob"], ".4f"),
                    _n(c["logit"], ".4f"),
                    _n(c["ulp_from_top1"], ".2f"),
                ]
                for j, c in enumerate(d[name]["topk_at_position"])
            ]
            lines += [
                "",
                f"top-k of {name.upper()} at position {d['position']}:",
                tabulate(
                    cand,
                    headers=["rank", "id", "text", "logprob", "logit", f"{d[name]['grid']['dtype']} ulp below top-1"],
                    tablefmt="simple",
                    disable_numparse=True,
                ),
            ]
    return "\n".join(lines)


def _n(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)
