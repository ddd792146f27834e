"""Text forms of a DiffResult: the summary line, a table per pair (plain or
markdown, via tabulate) and the JSON document. Formatting only: the numbers
come from classify.py.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from tabulate import tabulate

from .result import DiffResult, PairResult

# Order of the summary line after "N/P identical".
SUMMARY_ORDER = ("bf16_tie_flip", "post_eos", "cache_boundary", "unexplained", "incomparable")
Decoder = Callable[[int], str]


def summary_line(r: DiffResult) -> str:
    """'31/48 identical · 12 bf16_tie_flip · 3 post_eos · 2 cache_boundary · 0 unexplained · 0 incomparable'."""
    c = r.counts()
    return " · ".join([f"{c['identical']}/{c['pairs']} identical"] + [f"{c[k]} {k}" for k in SUMMARY_ORDER])


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "" if x is None or not math.isfinite(x) else format(x, fmt)


def _gap(nats: float | None, ulp: float | None, other_in: bool | None) -> str:
    if nats is None:
        return ""
    return (">=" if other_in is False else "") + f"{abs(nats):.3g}" + (f" ({abs(ulp):.3g}u)" if ulp is not None else "")


def _tok(t: int | None, decode: Decoder | None) -> str:
    if t is None:
        return ""
    return f"{t} {decode(t)!r}" if decode else str(t)


def _bound(x: int | None) -> str:
    return "?" if x is None else str(x)


def rows(
    r: DiffResult, only: Sequence[str] | None = None, decode: Decoder | None = None
) -> tuple[list[str], list[list]]:
    """Headers and one row per pair (filtered to classes `only` when given)."""
    teacher = any(p.teacher for p in r.pairs)
    head = [
        "key",
        "class",
        "pos",
        "token A",
        "token B",
        "gap A nats (ulp)",
        "gap B nats (ulp)",
        "boundary A/B",
        "drift max/mean",
        "top-k ∩",
        "vllm close",
        "rule",
    ] + (["teacher-forced"] if teacher else [])
    out = []
    for p in r.pairs:
        if only and p.cls not in only:
            continue
        vllm = "" if p.vllm_close is None else ("yes" if p.vllm_close else "no")
        drift = "" if p.drift_max is None else f"{p.drift_max:.3g}/{_num(p.drift_mean)}"
        row = [
            p.key,
            p.cls,
            "" if p.position is None else p.position,
            _tok(p.token_a, decode),
            _tok(p.token_b, decode),
            _gap(p.gap_a, p.gap_a_ulp, p.b_in_topk_a),
            _gap(p.gap_b, p.gap_b_ulp, p.a_in_topk_b),
            f"{_bound(p.boundary_a)}/{_bound(p.boundary_b)}",
            drift,
            _num(p.topk_overlap, ".2f"),
            vllm,
            p.rule,
        ]
        out.append(row + ([p.teacher or ""] if teacher else []))
    return head, out


def table(r: DiffResult, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    head, body = rows(r, only, decode)
    return tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)


def _header(r: DiffResult) -> list[str]:
    t = r.thresholds
    lines = [
        f"A: {r.a}",
        f"B: {r.b}",
        f"thresholds: tie {t.tie_ulps:g} ulp (raw logits) / {t.tie_nats:g} nats (logprobs only); "
        f"drift {t.drift_nats:g} nats",
        f"EOS ids: {', '.join(map(str, r.eos_ids)) or 'none'} ({r.eos_source})",
    ]
    return lines + [f"note: {n}" for n in r.notes]


def text(r: DiffResult, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    return "\n".join(_header(r) + [summary_line(r), "", table(r, only, decode)])


def markdown(r: DiffResult, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    """A block to paste into a pull request."""
    head, body = rows(r, only, decode)

    def esc(s):
        return str(s).replace("|", "\\|")

    body = [[esc(c) for c in row] for row in body]
    lines = [f"**tracekit diff**: {summary_line(r)}", ""] + [f"- {esc(x)}" for x in _header(r)] + [""]
    return "\n".join(lines) + "\n" + tabulate(body, headers=head, tablefmt="github", disable_numparse=True) + "\n"


def json_doc(results: Sequence[DiffResult]) -> dict:
    """One JSON document: the `tracekit.diff/1` object for one B, and for
    several B's the same objects under "comparisons" (each compared with A)."""
    if len(results) == 1:
        return results[0].to_json()
    docs = [r.to_json() for r in results]
    return {"schema": docs[0]["schema"], "a": results[0].a, "comparisons": docs}


def pair_line(p: PairResult) -> str:
    return f"{p.key}: {p.cls} {'' if p.position is None else 'at ' + str(p.position)} {p.rule}"
