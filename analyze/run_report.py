"""The full-matrix evidence of a `tracekit run` directory: one row per cell
(equality counts, classes, prefix reuse per request or from the engine's /metrics
counters, lifecycle checks, throughput, TTFT percentiles), the pitfalls the captures warned of,
every non-identical pair with its evidence, a JSON summary (schema
tracekit.matrix-report/1) and a markdown page for a PR.

Reads only what is under DIR, through `tracekit.rundir.RunDir` (the cells,
their checks and diffs, the manifest) and the traces they name. A file that
cannot be read is reported on its cell, never read as "no diff". Never imports capture/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tabulate import tabulate

from tracekit.errors import TraceFormatError
from tracekit.percentiles import percentiles
from tracekit.rundir import FAILING, LoadedCell, Manifest, PairEvidence, RunDir
from tracekit.store import TraceReader
from tracekit.verdicts import DIVERGENT, Verdict

from . import compare_targets, explain_cells
from . import run_report_sections as sections
from .classify import CLASSES

SCHEMA = "tracekit.matrix-report/1"


@dataclass(frozen=True)
class CellRow:
    """One cell of the report: the cell as read from DIR, and its burst's performance."""

    loaded: LoadedCell
    perf: Mapping[str, Any] = field(default_factory=dict)  # tokens_per_s, ttft_ms_p50/p90/p99, e2e_ms_p50
    perf_error: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)  # burst_facts: prefix reuse, counters, pitfalls

    @property
    def cell(self):
        return self.loaded.cell

    @property
    def diff(self):
        return self.loaded.diff

    @property
    def ok(self) -> bool:
        return self.loaded.passed

    @property
    def failed_checks(self) -> list[str]:
        return self.loaded.record.failed_checks

    def equality(self) -> str:
        return "—" if self.diff is None else f"{self.diff.identical}/{self.diff.n_pairs}"

    def as_dict(self) -> dict:
        r = self.loaded.record
        return {
            **{k: v for k, v in self.cell.to_json().items() if k not in ("engine_id", "group_id")},
            "verdict": "pass" if self.ok else "fail",
            "equality": self.equality(),
            "classes": None if self.diff is None else dict(self.diff.counts),
            "diff_error": self.loaded.diff_error,
            "checks": {c.name: c.status for c in r.checks},
            "failed_checks": self.failed_checks,
            "perf": dict(self.perf),
            "perf_error": self.perf_error,
            "prefix_reuse": {k: v for k, v in self.facts.items() if k != "pitfalls"},
            "pitfalls": [p["code"] for p in self.facts.get("pitfalls") or ()],
            "paths": {"baseline": r.baseline, "burst": r.burst, "diff": r.diff.path},
            "divergent": [_pair_json(p) for p in divergent(self)],
        }


@dataclass(frozen=True)
class Report:
    root: Path
    manifest: Manifest | None
    rows: tuple[CellRow, ...]
    summary: dict  # summary.json
    markdown: str  # report.md
    plots: dict  # name -> path relative to DIR
    unreadable: tuple[tuple[str, str], ...] = ()  # (cell id, why): cells that could not be read; they fail

    @property
    def failed_cells(self) -> list[str]:
        return [r.cell.id for r in self.rows if not r.ok] + [cid for cid, _ in self.unreadable] + missing(self.manifest)


def missing(man: Manifest | None) -> list[str]:
    """The cells of a merged run that no shard brought (absent shards, shards that stopped early):
    each counts as a failed cell, so a partial merge never reads as a pass."""
    return list((man.merged or {}).get("missing_cells", ())) if man is not None else []


def shards_json(man: Manifest | None) -> dict | None:
    """How a merged run was put together (None for a run that is not a merge); a single shard's
    record for a shard reported alone."""
    if man is None or (man.merged is None and man.shard is None):
        return None
    if man.merged is None:
        return {"shard": f"{man.shard['index']}/{man.shard['count']}", "cells": len(man.shard["cells"]),
                "matrix_cells": len(man.shard["matrix_cells"])}  # fmt: skip
    m = man.merged
    return {
        "count": m["count"],
        "given": [s["index"] for s in m["shards"]],
        "incomplete": [s["index"] for s in m["shards"] if not s["complete"]],
        "missing_shards": list(m["missing_shards"]),
        "missing_cells": list(m["missing_cells"]),
    }


def diff_document(a: Path, b: Path, teacher: Path | None = None) -> dict:
    """The differ of a matrix run (tracekit.capture.matrix.run): analyze.diff with defaults -> tracekit.diff/1."""
    from .compare import diff

    return diff(a, b, teacher=teacher).to_json()


def burst_facts(path: Path) -> tuple[dict, dict]:
    """(performance, facts) of a burst trace. Performance: throughput (generated tokens / wall span)
    and TTFT / E2E percentiles (ms) of ok rows. Facts: per-request prefix reuse (ok rows that
    reported cached tokens, and reused > 0), the engine's counters around the capture and the
    pitfalls it warned of (run metadata)."""
    with TraceReader(path) as r:
        t, rec = r.requests, r.meta.record
    ok = t.status == "ok"
    ct = t.cached_tokens[ok]
    facts = {
        "requests": int(ok.sum()),
        "cached_reported": int((ct >= 0).sum()),
        "reused": int((ct > 0).sum()),
        "counters": rec.prefix_cache_counters,
        "pitfalls": list(rec.pitfalls),
    }
    if not ok.any():
        return {}, facts
    span = float(t.t_done_s[ok].max() - t.t_sent_s[ok].min())
    ttft = percentiles((t.t_first_token_s - t.t_sent_s)[ok] * 1e3, ndigits=2)
    e2e = percentiles((t.t_done_s - t.t_sent_s)[ok] * 1e3, (50,), ndigits=2)
    toks = int(t.n_tokens[ok].sum())
    return {
        "requests": int(ok.sum()),
        "tokens": toks,
        "tokens_per_s": round(toks / span, 1) if span > 0 else None,
        **{f"ttft_ms_{q}": ttft.get(q) for q in ("p50", "p90", "p99")},
        "e2e_ms_p50": e2e.get("p50"),
    }, facts


def load_rows(root: str | Path) -> tuple[Manifest | None, list[CellRow], tuple[tuple[str, str], ...]]:
    """Every cell of a run directory, in run order, with its burst's performance; and the
    cells that could not be read at all (cell id, reason)."""
    rd = RunDir(root)
    view = rd.view()
    rows = []
    for c in view.cells:
        perf, facts, err = {}, {}, None
        if c.record.burst:
            try:
                perf, facts = burst_facts(rd.path(c.record.burst))
            except TraceFormatError as e:
                err = f"burst trace unreadable: {e}"
        rows.append(CellRow(c, perf, err, facts))
    return view.manifest, rows, view.unreadable


def divergent(row: CellRow) -> list[PairEvidence]:
    """The cell's non-identical pairs (incomparable ones included)."""
    return [p for p in row.diff.pairs if p.cls != "identical"] if row.diff else []


def _pair_json(p: PairEvidence) -> dict:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if k != "cls"} | {"class": p.cls}


def summary(
    root: str | Path, man: Manifest | None, rows: list[CellRow], plots: dict | None = None, unreadable=()
) -> dict:
    gone = missing(man)
    fails = [r.cell.id for r in rows if not r.ok] + [cid for cid, _ in unreadable] + gone
    return {
        "schema": SCHEMA,
        "dir": str(root),
        "matrix": None if man is None else {"name": man.matrix_name, "path": man.matrix_path},
        "tool": None if man is None else man.tool,
        "git_commit": None if man is None else man.git_commit,
        "host": None if man is None else dict(man.host),
        "cells": [r.as_dict() for r in rows],
        "unreadable": [{"id": cid, "error": why} for cid, why in unreadable],
        "shards": shards_json(man),
        "totals": {
            "cells": len(rows) + len(unreadable) + len(gone),
            "passed": len(rows) + len(unreadable) + len(gone) - len(fails),
            "failed": len(fails),
            **{k: sum(r.diff.counts[k] for r in rows if r.diff) for k in ("pairs", *CLASSES)},
        },
        "failed_cells": fails,
        "plots": plots or {},
        "cross_target": compare_targets.matched(rows),
        "explain": explain_cells.summary(explain_cells.load(root, [r.cell for r in rows])),
        "yardstick": sections.yardstick(Path(root), [r.loaded for r in rows])[1],
    }


def _checks_cell(r: CellRow) -> str:
    checks = r.loaded.record.checks
    passed = sum(c.status == "pass" for c in checks)
    skipped = [c.name for c in checks if c.status == "skip"]
    s = f"{passed}/{len(checks)}"
    if r.failed_checks:
        s += " FAIL " + ", ".join(r.failed_checks)
    return s + (f" (skip {', '.join(skipped)})" if skipped else "")


def _fmt(x, suffix="") -> str:
    return "" if x is None else f"{x:g}{suffix}"


# the report's short column heads, in the verdict vocabulary's order (tracekit/verdicts.py)
SHORT = {
    Verdict.BF16_TIE_FLIP: "tie flip",
    Verdict.POST_EOS: "post EOS",
    Verdict.CACHE_BOUNDARY: "cache bnd",
    Verdict.UNEXPLAINED: "unexpl.",
    Verdict.INCOMPARABLE: "incomp.",
}


def table_rows(rows: list[CellRow]) -> tuple[list[str], list[list[str]]]:
    head = [
        "cell",
        "dtype",
        "cache",
        "conc",
        "identical",
        *(SHORT[v] for v in DIVERGENT),
        "reuse",
        "checks",
        "tok/s",
        "TTFT p50/p90/p99 ms",
        "verdict",
    ]
    body = []
    for r in rows:
        c, p = r.cell, r.perf
        counts = r.diff.counts if r.diff else {}
        ttft = "/".join(_fmt(p.get(f"ttft_ms_p{q}")) for q in (50, 90, 99)) if p else ""
        body.append(
            [
                f"{c.target} {c.prompts} out{c.output_tokens}",
                c.dtype.upper(),
                "on" if c.prefix_cache else "off",
                str(c.concurrency),
                r.equality(),
                *(str(counts.get(k, "—")) for k in (v.value for v in DIVERGENT)),
                sections.reuse(r.facts),
                _checks_cell(r),
                _fmt(p.get("tokens_per_s")),
                ttft,
                "PASS" if r.ok else "**FAIL**",
            ]
        )
    return head, body


def text_table(rows: list[CellRow]) -> str:
    head, body = table_rows(rows)
    return tabulate(
        [[c.replace("**", "") for c in row] for row in body], headers=head, tablefmt="simple", disable_numparse=True
    )


def _num(x, digits: int = 3) -> str:
    return "?" if x is None else f"{abs(x):.{digits}g}"


def _ulps(p) -> str:
    """The gaps in steps; a pair measured in nats only (no raw logits) says so, never '? / ?'."""
    if p.gap_a_ulp is None and p.gap_b_ulp is None and (p.gap_a is not None or p.gap_b is not None):
        return "nats only (no logits)"
    return _side(p.gap_a_ulp, p.gap_b_ulp, _num)


def _side(a, b, fmt=str) -> str:
    return f"{'?' if a is None else fmt(a)} / {'?' if b is None else fmt(b)}"


PAIR_HEAD = [
    "cell (A = serial c1, B = burst)",
    "key",
    "class",
    "pos",
    "token A / B",
    "gap A / B nats",
    "gap A / B ulp",
    "reused prefix A / B",
    "drift before",
    "rule",
    "teacher-forced",
]


def pair_rows(rows: list[CellRow]) -> list[list[str]]:
    """One row per non-identical pair of every cell, with the evidence of its verdict."""
    out = []
    for r in rows:
        c = r.cell
        for p in divergent(r):
            out.append(
                [
                    f"{c.target} {c.dtype.upper()} cache-{'on' if c.prefix_cache else 'off'} "
                    f"{c.prompts} c{c.concurrency}",
                    p.key,
                    p.cls,
                    "" if p.position is None else str(p.position),
                    _side(p.token_a, p.token_b),
                    _side(p.gap_a, p.gap_b, _num),
                    _ulps(p),
                    _side(p.boundary_a, p.boundary_b),
                    _num(p.drift_max),
                    p.rule,
                    p.teacher or "",
                ]
            )
    return out


def pair_table(rows: list[CellRow], fmt: str = "github") -> str:
    """Every non-identical pair as a table (markdown by default; pipes inside cells escaped)."""
    body = pair_rows(rows)
    if not body:
        return "(no divergent pair)"
    if fmt == "github":
        body = [[x.replace("|", "\\|") for x in row] for row in body]
    return tabulate(body, headers=PAIR_HEAD, tablefmt=fmt, disable_numparse=True)


def markdown(
    root: str | Path, man: Manifest | None, rows: list[CellRow], plots: dict | None = None, unreadable=()
) -> str:
    """The PR page: verdict, what A and B are, the cell table, every non-identical pair with its
    evidence, failures, the setup, and the plots (as attachments)."""
    root = Path(root)
    head, body = table_rows(rows)
    n_ok, n = sum(r.ok for r in rows), len(rows) + len(unreadable) + len(missing(man))
    lines = [
        f"## tracekit matrix evidence: {man.matrix_name if man else root.name}",
        "",
        f"**{n_ok}/{n} cells pass** (a cell fails on any `unexplained` or `incomparable` pair, "
        "or any failed check: lifecycle, the run-level `calibration` test, the `cold_reference` diff). "
        "Identical = A vs B, equal token ids.",
        "",
        sections.AB_TEXT,
        "",
        tabulate(body, headers=head, tablefmt="github", disable_numparse=True),
        "",
        f"### Non-identical pairs ({sum(len(divergent(r)) for r in rows)})",
        "",
        pair_table(rows),
        "",
        sections.PAIR_LEGEND,
        "",
    ]
    lines += sections.yardstick(root, [r.loaded for r in rows])[0]
    lines += explain_cells.markdown(explain_cells.load(root, [r.cell for r in rows]))
    lines += compare_targets.markdown(compare_targets.matched(rows))
    lines += sections.pitfalls((r.cell.id, r.facts) for r in rows)
    lines += sections.shards(man) + _failures(rows, unreadable) + sections.setup(man)
    lines += sections.plot_lines(root, plots)
    return "\n".join(lines) + "\n"


def _failures(rows: list[CellRow], unreadable=()) -> list[str]:
    out = [f"- **{cid}**: unreadable: {why}" for cid, why in unreadable]
    for r in rows:
        notes = [f"perf: {r.perf_error}"] if r.perf_error else []
        if r.ok and not notes:
            continue
        d = r.diff
        bad = [f"{d.counts[k]} {k} ({', '.join(p.key for p in d.pairs if p.cls == k)})" for k in FAILING] if d else []
        out.append(
            f"- **{r.cell.id}**: "
            + "; ".join(
                [b for b, k in zip(bad, FAILING) if d.counts[k]]
                + ([r.loaded.diff_error or "no diff"] if d is None else [])
                + [f"{c.name}: {c.summary}" for c in r.loaded.record.checks if c.status == "fail"]
                + notes
            )
        )
    return (["### Failed cells and read errors", ""] + out + [""]) if out else []


def write_report(root: str | Path, pair: tuple[str, str] | None = None, plots: bool = True) -> Report:
    """Write DIR/report/{report.md, summary.json, *.png} and return the Report."""
    rd = RunDir(root)
    man, rows, unreadable = load_rows(rd.root)
    out = rd.report_dir
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    if plots:
        from .plots import make_plots

        made = make_plots(rd, [r.loaded for r in rows], out, pair)
    rel = {k: Path(v).relative_to(rd.root).as_posix() for k, v in made.items()}
    doc = summary(rd.root, man, rows, rel, unreadable)
    md = markdown(rd.root, man, rows, rel, unreadable)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "report.md").write_text(md)
    return Report(rd.root, man, tuple(rows), doc, md, rel, unreadable)
