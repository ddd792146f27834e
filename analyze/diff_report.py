"""Text forms of a DiffResult: the summary line, a table per pair (plain or
markdown, via tabulate) and the JSON document. Formatting only: the numbers
come from classify.py. Every form carries the same facts: each trace's grid and
where it came from, the tolerances in force, the EOS ids and their source (or
that they are unknown, and how to fix it), findings, notes, and a filter when
--only hid pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from tabulate import tabulate

from tracekit.verdicts import DIVERGENT

from .result import SCHEMA, DiffResult

# Order of the summary line after "N/P identical".
SUMMARY_ORDER = tuple(v.value for v in DIVERGENT)  # the verdict vocabulary's order (tracekit/verdicts.py)
Decoder = Callable[[int], str]
LEGEND = (
    "gap: how far each side's own token lies above the other side's token in that trace "
    "(nats from logprobs; `u` = steps of the run's grid, from raw logits; `>=` = the other token is "
    "outside the top-k); boundary: reused-prefix tokens (cached_tokens); drift: |Δ chosen logprob| "
    "before the difference, max/mean; top-k ∩: share of A's top-k in B's; vllm close: vLLM's "
    "check_logprobs_close (each token in the other's top-k), for comparison only."
)


@dataclass(frozen=True)
class Failed:
    """A comparison that could not be made (`tracekit diff A B C`: C shares no key with A)."""

    a: str
    b: str
    error: str
    ok = False

    def to_json(self, only=None) -> dict:
        return {"schema": SCHEMA, "a": self.a, "b": self.b, "error": self.error}


def summary_line(r: DiffResult) -> str:
    """'31/48 identical · 12 bf16_tie_flip · 3 post_eos · 2 cache_boundary · 0 unexplained · 0 incomparable'."""
    c = r.counts()
    return " · ".join([f"{c['identical']}/{c['pairs']} identical"] + [f"{c[k]} {k}" for k in SUMMARY_ORDER])


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "" if x is None or not math.isfinite(x) else format(x, fmt)


def _gap(nats: float | None, ulp: float | None, other_in: bool | None) -> str:
    if nats is None and ulp is None:
        return ""
    lo = ">=" if other_in is False else ""
    n = f"{abs(nats):.3g}" if nats is not None else "?"
    return lo + n + (f" ({abs(ulp):.3g}u)" if ulp is not None else "")


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
            p.rule + (f" [{p.note}]" if p.note and p.note not in p.rule else ""),
        ]
        out.append(row + ([p.teacher or ""] if teacher else []))
    return head, out


def table(r: DiffResult, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    head, body = rows(r, only, decode)
    return tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)


def _mean_rule(mean: float, drift: float) -> str:
    """The mean-drift bound as analyze/rules.py applies it per row: it tightens from the max-drift
    bound at 1 position towards the mean tolerance, m + (x - m) / n (on logits the same in grid
    steps: both divided by the step)."""
    return f"{mean:g} + ({drift:g} - {mean:g}) / n"


def _thresholds(r: DiffResult) -> list[str]:
    th = r.thresholds_json()
    out = []
    for d, t in th["by_dtype"].items():
        out.append(
            f"thresholds ({d}): tie {t['tie_ulps']:g} ulp / {t['tie_nats']:g} nats; drift {t['drift_ulps']:g} ulp / "
            f"{t['drift_nats']:g} nats, mean <= {_mean_rule(t['drift_mean_nats'], t['drift_nats'])} nats "
            f"over n positions (each row prints its own); grid floor |x| {th['grid_floor']:g}"
        )
    return out


def _findings(r: DiffResult) -> list[str]:
    f = r.findings()
    out = []
    if f["nonfinite_pairs"]:
        out.append(
            f"findings: {f['nonfinite_pairs']} pair(s) with a NaN/inf logprob on one side only "
            f"({f['nonfinite_positions']} position(s))"
        )
    if f["inconsistent_pairs"]:
        out.append(f"findings: {f['inconsistent_pairs']} pair(s) whose logprob column contradicts its top-k rows")
    if f["truncated_pairs"]:
        out.append(f"findings: {f['truncated_pairs']} pair(s) with a truncated stream")
    return out


def _header(r: DiffResult, only: Sequence[str] | None = None) -> list[str]:
    g, lab = r.grids, r.labels

    def who(s: str, path: str) -> str:
        return (
            f"{s.upper()}: {path}"
            + (f"  [{lab[s]}]" if lab.get(s) else "")
            + (f"  (grid {g[s].describe()})" if s in g else "")
        )

    lines = [
        who("a", r.a),
        who("b", r.b),
        *_thresholds(r),
        f"EOS ids: {', '.join(map(str, r.eos_ids))} ({r.eos_source})" if r.eos_ids else f"EOS ids {r.eos_source}",
        *_findings(r),
    ]
    if only:
        shown = sum(p.cls in only for p in r.pairs)
        lines.append(f"--only {','.join(only)}: listing {shown} of {len(r)} pairs")
    return lines + [f"note: {n}" for n in r.notes if not n.startswith("EOS ids unknown")]


def _failed(r: Failed) -> str:
    return f"A: {r.a}\nB: {r.b}\ncomparison failed: {r.error}"


def text(r: DiffResult | Failed, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    if isinstance(r, Failed):
        return _failed(r)
    return "\n".join(_header(r, only) + [summary_line(r), "", table(r, only, decode)])


def markdown(r: DiffResult | Failed, only: Sequence[str] | None = None, decode: Decoder | None = None) -> str:
    """A block to paste into a pull request."""
    if isinstance(r, Failed):
        return f"**tracekit diff**: comparison failed\n\n- A: {r.a}\n- B: {r.b}\n- error: {r.error}\n"
    head, body = rows(r, only, decode)

    def esc(s):
        return str(s).replace("|", "\\|")

    body = [[esc(c) for c in row] for row in body]
    lines = [f"**tracekit diff**: {summary_line(r)}", ""] + [f"- {esc(x)}" for x in _header(r, only)] + [""]
    table_md = tabulate(body, headers=head, tablefmt="github", disable_numparse=True)
    return "\n".join(lines) + "\n" + table_md + "\n\n" + f"_Legend_: {esc(LEGEND)}\n"


def json_doc(results: Sequence[DiffResult | Failed], only: Sequence[str] | None = None) -> dict:
    """One JSON document: the `tracekit.diff/2` object for one B, and for
    several B's the same objects under "comparisons" (each compared with A; a
    comparison that could not be made is {"schema", "a", "b", "error"})."""
    if len(results) == 1:
        return results[0].to_json(only)
    return {"schema": SCHEMA, "a": results[0].a, "comparisons": [r.to_json(only) for r in results]}
