"""The causes `tracekit explain` found for a run directory's flips, for `tracekit report` and
`tracekit demo`: read from each cell's `cells/<id>/explain/explain.json` (schema
tracekit.explain/1, written by `tracekit explain RUN_DIR` or by the demo; read through
`RunDir.read_explain`), one row per explained pair, and the section of report.md / the
demo page that shows them.

A cell without one was not explained (said, not guessed). A file that cannot be read is
listed with the reason, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tabulate import tabulate

from tracekit.rundir import Cell, RunDir

from .explain import OK_KINDS  # one vocabulary of causes


@dataclass(frozen=True)
class CellCauses:
    cell: Cell
    doc: dict | None  # the tracekit.explain/1 document, None when unreadable
    error: str | None = None

    @property
    def pairs(self) -> list[dict]:
        return list((self.doc or {}).get("pairs") or [])


def cell_label(c: Cell) -> str:
    return f"{c.target} {c.dtype.upper()} cache-{'on' if c.prefix_cache else 'off'} {c.prompts} c{c.concurrency}"


def load(root: str | Path, cells: Iterable[Cell]) -> list[CellCauses]:
    """The explained cells of DIR, in the order given (cells without an explain.json are left out)."""
    rd = RunDir(root)
    out = []
    for c in cells:
        doc, error = rd.read_explain(c.id)
        if doc is not None or error is not None:
            out.append(CellCauses(c, doc, error))
    return out


def _config(p: dict, config: str) -> str:
    """'A 20/20' (or 'A 12/20, B 8/20') over every run of one configuration; '' when not run."""
    vs = [v for v in p.get("variants") or () if v.get("config") == config]
    n = sum(v["n"] for v in vs)
    if not n:
        return ""
    a, b = sum(v["a"] for v in vs), sum(v["b"] for v in vs)
    parts = [f"A {a}/{n}"] * bool(a) + [f"B {b}/{n}"] * bool(b) or [f"neither 0/{n}"]
    return ", ".join(parts) + (" STILL FLIPS" if config == "deterministic" and a and b else "")


def cause_rows(causes: list[CellCauses]) -> list[list[str]]:
    """One row per explained pair: cell, key, class, t, cause (LOUD first), right side,
    the deterministic and FP32 configurations' tokens."""
    out = []
    for cc in causes:
        for p in cc.pairs:
            out.append(
                [
                    cell_label(cc.cell),
                    str(p["key"]),
                    str(p["class"]),
                    str(p["position"]),
                    str(p["cause"]),
                    str(p.get("right_side") or "unknown"),
                    _config(p, "deterministic"),
                    _config(p, "fp32"),
                ]
                + ([engine_replay_cell(p)] if _has_engine_replay(causes) else [])
            )
    return out


HEAD = ["cell", "key", "class", "pos", "cause (tracekit explain)", "right side", "deterministic", "FP32"]
ENGINE_HEAD = "engine's own replay: cold / at A's / at B's boundary"


def _has_engine_replay(causes: list[CellCauses]) -> bool:
    return any(str(h).startswith("engine:") for cc in causes for p in cc.pairs for h in (p.get("teacher") or {}))


def engine_replay_cell(p: dict) -> str:
    """Which token the engine's own replay (explain --engine-replay) gives at t, cold and at each
    side's boundary: 'A / A / B' ('-' where that history was not run or not proven)."""
    rows = {str(h).rsplit(" ", 1)[0]: v for h, v in (p.get("teacher") or {}).items() if str(h).startswith("engine:")}

    def at(boundary: int) -> str:
        v = rows.get(f"engine:warm:{boundary}" if boundary > 0 else "engine:cold")
        return "-" if v is None else "A" if v == p["token_a"] else "B" if v == p["token_b"] else str(v)

    return f"{at(0)} / {at(int(p.get('boundary_a', -1)))} / {at(int(p.get('boundary_b', -1)))}"


def counts(causes: list[CellCauses]) -> dict[str, int]:
    pairs = [p for cc in causes for p in cc.pairs]
    out = {k: sum(p["kind"] == k for p in pairs) for k in (*OK_KINDS, "unresolved", "bug")}
    return {"pairs": len(pairs), **out, "loud": sum(bool(p.get("loud")) for p in pairs)}


def headline(causes: list[CellCauses]) -> str:
    """'15 pairs explained: 14 batch composition, 1 bug · 1 LOUD (...)'"""
    c = counts(causes)
    parts = [f"{v} {k.replace('_', ' ')}" for k, v in c.items() if v and k not in ("pairs", "loud")]
    loud = f" · {c['loud']} LOUD (classed benign, no variant reproduced it)" if c["loud"] else ""
    return f"{c['pairs']} pairs explained: " + (", ".join(parts) or "none") + loud


def loud_lines(causes: list[CellCauses]) -> list[str]:
    return [
        f"LOUD: {cell_label(cc.cell)} · {p['key']}: {str(p['cause']).removeprefix('LOUD: ')}"
        for cc in causes
        for p in cc.pairs
        if p.get("loud")
    ]


def text_lines(causes: list[CellCauses]) -> list[str]:
    """The plain-text form (the demo's page): one line per explained pair, LOUD ones flagged."""
    out = []
    for cc in causes:
        for p in cc.pairs:
            det, fp = _config(p, "deterministic"), _config(p, "fp32")
            out.append(
                f"{cell_label(cc.cell)} · {p['key']} · t={p['position']} · {p['cause']}"
                + f" · right side: {p.get('right_side') or 'unknown'}"
                + (f" · deterministic: {det}" if det else "")
                + (f" · FP32: {fp}" if fp else "")
                + (
                    f" · engine replay cold / at A / at B: {engine_replay_cell(p)}"
                    if any(str(h).startswith("engine:") for h in (p.get("teacher") or {}))
                    else ""
                )
            )
        if cc.error:
            out.append(f"{cell_label(cc.cell)}: {cc.error}")
    return out


def table(causes: list[CellCauses], fmt: str = "github") -> str:
    body = cause_rows(causes)
    head = HEAD + ([ENGINE_HEAD] if _has_engine_replay(causes) else [])
    if fmt == "github":
        body = [[x.replace("|", "\\|") for x in row] for row in body]
    return tabulate(body, headers=head, tablefmt=fmt, disable_numparse=True)


LEGEND = (
    "Each divergent pair was rerun on a live engine of its cell's configuration (`tracekit explain`, "
    "docs/explain.md): alone cold (the prefix cache flushed, or llama.cpp's `cache_prompt: false`), alone "
    "warm primed at each side's reused-prefix boundary, and in a burst with its batch mates from B, each "
    "repeated; each run's reported reused prefix is kept, and a cause names a boundary only where the runs "
    "reused it (llama.cpp without `--slot-save-path` cannot be primed: what ran is said); `cause` names the variant "
    "that gives B's token while its control does not, with counts. `right side` is the side whose "
    "token the teacher-forced FP32 full-history argmax picks; `deterministic` and `FP32` count the "
    "tokens the same variants chose on the target's deterministic and FP32 configurations. The engine's own "
    "replay (explain --engine-replay): which side's token the engine itself gives at t for A's exact tokens, "
    "cold and with the cache primed at A's and at B's boundary (each boundary proven by its report)."
)


def markdown(causes: list[CellCauses]) -> list[str]:
    """report.md's section (empty when no cell was explained)."""
    if not causes:
        return []
    out = [f"### Cause of each flip ({headline(causes)})", ""]
    if any(cc.pairs for cc in causes):
        out += [table(causes), ""]
    out += [f"- **{x}**" for x in loud_lines(causes)]
    out += [f"- {cell_label(cc.cell)}: {cc.error}" for cc in causes if cc.error]
    notes = dict.fromkeys(n for cc in causes for n in (cc.doc or {}).get("notes") or ())
    out += [f"- note: {n}" for n in notes]
    return out + ["", LEGEND, ""]


def summary(causes: list[CellCauses]) -> dict:
    """summary.json's `explain`: counts, and per cell its pairs' kind, cause, loudness, right side."""
    return {
        "counts": counts(causes),
        "cells": [
            {
                "id": cc.cell.id,
                "error": cc.error,
                "pairs": [
                    {k: p.get(k) for k in ("key", "class", "position", "kind", "cause", "loud", "right_side")}
                    for p in cc.pairs
                ],
            }
            for cc in causes
        ],
    }
