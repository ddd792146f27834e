"""The full-matrix evidence of a `tracekit run` directory: one row per cell
(equality counts, classes, lifecycle checks, throughput, TTFT percentiles), a
JSON summary (schema tracekit.matrix-report/1) and a markdown page for a PR.

Reads only what is under DIR: manifest.json, cells/*/cell.json, checks.json,
diff.json and the traces they name. Never imports capture/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tabulate import tabulate

from tracekit.errors import ConfigError
from tracekit.store import TraceReader

from .classify import CLASSES

SCHEMA = "tracekit.matrix-report/1"
FAILING = ("unexplained", "incomparable")


@dataclass(frozen=True)
class CellRow:
    cell: dict  # cell.json: id, target, dtype, prefix_cache, prompts, concurrency, paths
    diff: dict | None  # tracekit.diff/1 summary (None: no diff, e.g. a capture failed)
    checks: tuple[dict, ...]
    perf: dict = field(default_factory=dict)  # burst: tokens_per_s, ttft_ms p50/p90/p99, e2e_ms p50

    @property
    def failed_checks(self) -> list[str]:
        return [c["name"] for c in self.checks if c["status"] == "fail"]

    @property
    def ok(self) -> bool:
        return self.diff is not None and not any(self.diff[k] for k in FAILING) and not self.failed_checks

    def equality(self) -> str:
        return "—" if self.diff is None else f"{self.diff['identical']}/{self.diff['pairs']}"

    def as_dict(self) -> dict:
        return {
            **{
                k: self.cell.get(k)
                for k in ("id", "target", "dtype", "prefix_cache", "prompts", "output_tokens", "concurrency")
            },
            "verdict": "pass" if self.ok else "fail",
            "equality": self.equality(),
            "classes": self.diff,
            "checks": {c["name"]: c["status"] for c in self.checks},
            "failed_checks": self.failed_checks,
            "perf": self.perf,
            "paths": {k: self.cell.get(k) for k in ("baseline", "burst", "diff", "checks")},
        }


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pct(x: np.ndarray, q: float) -> float | None:
    x = x[np.isfinite(x)]
    return round(float(np.percentile(x, q)), 2) if len(x) else None


def burst_perf(path: Path) -> dict:
    """Throughput (generated tokens / wall span) and TTFT / E2E percentiles (ms) of ok rows."""
    try:
        with TraceReader(path) as r:
            t = r.requests
    except Exception:  # noqa: BLE001 - a missing or broken trace leaves the cell without perf numbers
        return {}
    ok = t.status == "ok"
    if not ok.any():
        return {}
    span = float(t.t_done_s[ok].max() - t.t_sent_s[ok].min())
    ttft = (t.t_first_token_s - t.t_sent_s)[ok] * 1e3
    e2e = (t.t_done_s - t.t_sent_s)[ok] * 1e3
    toks = int(t.n_tokens[ok].sum())
    return {
        "requests": int(ok.sum()),
        "tokens": toks,
        "tokens_per_s": round(toks / span, 1) if span > 0 else None,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p90": _pct(ttft, 90),
        "ttft_ms_p99": _pct(ttft, 99),
        "e2e_ms_p50": _pct(e2e, 50),
    }


def load_cells(root: str | Path) -> list[CellRow]:
    """Every cell of a run directory, in the manifest's order (directory order without one)."""
    root = Path(root)
    if not (root / "cells").is_dir():
        raise ConfigError(f"{root}: not a `tracekit run` directory (no cells/); run `tracekit run MATRIX --out DIR`")
    man = _json(root / "manifest.json") or {}
    ids = [c["id"] for c in man.get("cells", [])] or sorted(p.name for p in (root / "cells").iterdir())
    diff_errors = {c["id"]: c.get("diff_error") for c in man.get("cells", [])}
    rows = []
    for cid in ids:
        cell = _json(root / "cells" / cid / "cell.json")
        if cell is None:
            raise ConfigError(f"{root}/cells/{cid}/cell.json: missing or not JSON; the run is incomplete")
        cell["diff_error"] = diff_errors.get(cid)
        d = _json(root / "cells" / cid / "diff.json")
        checks = (_json(root / "cells" / cid / "checks.json") or {}).get("checks", [])
        perf = burst_perf(root / cell["burst"]) if cell.get("burst") else {}
        rows.append(CellRow(cell, d["summary"] if d else None, tuple(checks), perf))
    if not rows:
        raise ConfigError(f"{root}: the run has no cells")
    return rows


def summary(root: str | Path, rows: list[CellRow], plots: dict | None = None) -> dict:
    man = _json(Path(root) / "manifest.json") or {}
    fails = [r.cell["id"] for r in rows if not r.ok]
    return {
        "schema": SCHEMA,
        "dir": str(root),
        "matrix": man.get("matrix"),
        "tool": man.get("tool"),
        "git_commit": man.get("git_commit"),
        "host": man.get("host"),
        "cells": [r.as_dict() for r in rows],
        "totals": {
            "cells": len(rows),
            "passed": len(rows) - len(fails),
            "failed": len(fails),
            **{k: sum((r.diff or {}).get(k, 0) for r in rows) for k in ("pairs", *CLASSES)},
        },
        "failed_cells": fails,
        "plots": plots or {},
    }


def _checks_cell(r: CellRow) -> str:
    n = len(r.checks)
    passed = sum(c["status"] == "pass" for c in r.checks)
    skipped = [c["name"] for c in r.checks if c["status"] == "skip"]
    s = f"{passed}/{n}"
    if r.failed_checks:
        s += " FAIL " + ", ".join(r.failed_checks)
    return s + (f" (skip {', '.join(skipped)})" if skipped else "")


def _fmt(x, suffix="") -> str:
    return "" if x is None else f"{x:g}{suffix}"


def table_rows(rows: list[CellRow]) -> tuple[list[str], list[list[str]]]:
    head = [
        "cell",
        "dtype",
        "cache",
        "conc",
        "identical",
        "tie flip",
        "cache bnd",
        "post EOS",
        "unexpl.",
        "incomp.",
        "checks",
        "tok/s",
        "TTFT p50/p90/p99 ms",
        "verdict",
    ]
    body = []
    for r in rows:
        c, d, p = r.cell, r.diff or {}, r.perf
        ttft = "/".join(_fmt(p.get(f"ttft_ms_p{q}")) for q in (50, 90, 99)) if p else ""
        body.append(
            [
                f"{c['target']} {c['prompts']} out{c['output_tokens']}",
                c["dtype"].upper(),
                "on" if c["prefix_cache"] else "off",
                str(c["concurrency"]),
                r.equality(),
                *(
                    str(d.get(k, "—"))
                    for k in ("bf16_tie_flip", "cache_boundary", "post_eos", "unexplained", "incomparable")
                ),
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


def markdown(root: str | Path, rows: list[CellRow], plots: dict | None = None) -> str:
    """The PR page: setup (tool, commit, host, engine commands), the table, failures with evidence, plots."""
    root = Path(root)
    man = _json(root / "manifest.json") or {}
    head, body = table_rows(rows)
    n_ok = sum(r.ok for r in rows)
    lines = [
        f"## tracekit matrix evidence: {(man.get('matrix') or {}).get('name', root.name)}",
        "",
        f"**{n_ok}/{len(rows)} cells pass** (a cell fails on any `unexplained` or `incomparable` pair, "
        "or any failed lifecycle check). Identical = serial baseline vs concurrent burst, equal token ids.",
        "",
        tabulate(body, headers=head, tablefmt="github", disable_numparse=True),
        "",
    ]
    lines += _failures(rows) + _setup(man) + _plot_lines(root, plots)
    return "\n".join(lines) + "\n"


def _failures(rows: list[CellRow]) -> list[str]:
    out = []
    for r in rows:
        if r.ok:
            continue
        out.append(
            f"- **{r.cell['id']}**: "
            + "; ".join(
                [f"{r.diff[k]} {k}" for k in FAILING if r.diff and r.diff[k]]
                + ([r.cell.get("diff_error") or "no diff"] if r.diff is None else [])
                + [f"{c['name']}: {c['summary']}" for c in r.checks if c["status"] == "fail"]
            )
        )
    return (["### Failed cells", ""] + out + [""]) if out else []


def _setup(man: dict) -> list[str]:
    if not man:
        return ["(no manifest.json: setup unknown)", ""]
    host = man.get("host") or {}
    out = [
        "### Setup",
        "",
        f"- tool: {man.get('tool')}, commit `{man.get('git_commit')}`",
        f"- command: `{man.get('command')}`",
        f"- host: {host.get('hostname')} ({host.get('platform')}, {host.get('cpus')} CPUs, "
        f"Python {host.get('python')})",
        f"- run: {man.get('started_utc')} → {man.get('finished_utc')}",
    ]
    for eid, e in (man.get("engines") or {}).items():
        meta = (((e.get("self_report") or {}).get("v1_models") or {}).get("data") or [{}])[0].get("meta") or {}
        desc = ", ".join(
            f"{k}={meta[k]}"
            for k in ("engine", "version", "dtype", "attn", "slots", "prefix_cache", "inject_fault")
            if k in meta
        )
        cmd = " ".join(e.get("command") or []) or e.get("url", "")
        out.append(
            f"- engine `{eid}`: `{cmd}`"
            + (f" — self-report: {desc}" if desc else "")
            + (f" — **did not start**: {e['error'][:200]}" if e.get("error") else "")
        )
    out.append(f"- {len(man.get('files') or {})} files with sha256 in `manifest.json`")
    return out + [""]


def _plot_lines(root: Path, plots: dict | None) -> list[str]:
    if not plots:
        return []
    out = ["### Plots", ""]
    for name, path in plots.items():
        rel = Path(path).resolve().relative_to((root / "report").resolve()).as_posix()
        out.append(f"![{name}]({rel})")
    return out + [""]


def write_report(
    root: str | Path, pair: tuple[str, str] | None = None, plots: bool = True
) -> tuple[list[CellRow], dict, str]:
    """Write DIR/report/{report.md, summary.json, *.png}; returns (rows, summary JSON, markdown)."""
    root = Path(root)
    rows = load_cells(root)
    out = root / "report"
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    if plots:
        from .plots import make_plots

        made = make_plots(root, [r.cell for r in rows], out, pair)
    doc = summary(root, rows, {k: Path(v).relative_to(root).as_posix() for k, v in made.items()})
    md = markdown(root, rows, made)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "report.md").write_text(md)
    return rows, doc, md
