"""Matched cells across targets: the same cell (every axis equal but the target) on two engines.

A matrix with several targets (two engines, one engine in two configurations such as
`--slots 1` and `--slots 4`, two models) runs each cell once per target. This module
pairs those cells and puts their burst figures side by side: both absolute values and
the ratio (other ÷ reference), the reference being the first target in run order. A
cell missing on one side, or a figure missing (no ok request), is shown as such, never
as a ratio of zero. Equality (A vs B within each target's cell) is listed for both, so a
faster configuration that diverges more is visible in the same row.
"""

from __future__ import annotations

from typing import Iterable

from tabulate import tabulate

METRICS = (  # (perf key, label, higher is better)
    ("tokens_per_s", "tok/s", True),
    ("ttft_ms_p50", "TTFT p50 ms", False),
    ("ttft_ms_p99", "TTFT p99 ms", False),
    ("e2e_ms_p50", "E2E p50 ms", False),
)


def _axes(cell) -> tuple:
    return (cell.prompts, cell.output_tokens, cell.dtype, cell.prefix_cache, cell.concurrency)


def _ratio(a, b):
    if a is None or b is None or a == 0:
        return None
    return round(b / a, 3)


def matched(rows: Iterable) -> list[dict]:
    """One entry per (cell axes, other target): both targets' figures and other ÷ reference.
    rows: tracekit.analyze.run_report.CellRow (cell, perf, equality())."""
    rows = list(rows)
    targets = list(dict.fromkeys(r.cell.target for r in rows))
    if len(targets) < 2:
        return []
    by = {(r.cell.target, _axes(r.cell)): r for r in rows}
    ref = targets[0]
    out = []
    for axes in dict.fromkeys(_axes(r.cell) for r in rows):
        a = by.get((ref, axes))
        for other in targets[1:]:
            b = by.get((other, axes))
            if a is None or b is None:
                continue
            entry = {
                "prompts": axes[0],
                "output_tokens": axes[1],
                "dtype": axes[2],
                "prefix_cache": axes[3],
                "concurrency": axes[4],
                "reference": ref,
                "other": other,
                "equality": {ref: a.equality(), other: b.equality()},
                "metrics": {},
            }
            for key, _, _ in METRICS:
                va, vb = a.perf.get(key), b.perf.get(key)
                entry["metrics"][key] = {ref: va, other: vb, "ratio": _ratio(va, vb)}
            out.append(entry)
    return out


def _fmt(x) -> str:
    return "—" if x is None else f"{x:g}"


def markdown(entries: list[dict]) -> list[str]:
    """The report section (empty when the run has one target)."""
    if not entries:
        return []
    head = ["cell (all axes equal)", "targets (ref → other)", "identical ref / other"]
    head += [f"{label} ref / other (×)" for _, label, _ in METRICS]
    body = []
    for e in entries:
        ref, other = e["reference"], e["other"]
        cells = [
            f"{e['prompts']} out{e['output_tokens']} {e['dtype'].upper()} "
            f"cache-{'on' if e['prefix_cache'] else 'off'} c{e['concurrency']}",
            f"{ref} → {other}",
            f"{e['equality'][ref]} / {e['equality'][other]}",
        ]
        for key, _, _ in METRICS:
            m = e["metrics"][key]
            cells.append(f"{_fmt(m[ref])} / {_fmt(m[other])} ({_fmt(m['ratio'])}×)")
        body.append(cells)
    return [
        f"### Across targets ({len(entries)} matched cells)",
        "",
        "Cells whose axes are all equal but the target; figures of each burst and the ratio "
        "other ÷ reference (reference = the first target in run order). Throughput counts `ok` "
        "requests only; a missing figure is —.",
        "",
        tabulate(body, headers=head, tablefmt="github", disable_numparse=True),
        "",
    ]
