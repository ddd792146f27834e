"""The parts of the matrix report page (analyze/run_report.py) that describe the run rather
than its cells: what A and B are, the pair table's legend, the pitfalls each capture warned of,
the setup (tool, host, engines) and the plots. Text only; reads nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from tracekit.rundir import Manifest
from tracekit.text import clip

AB_TEXT = (
    "**A and B.** In every cell A is the serial baseline (one request at a time, "
    "`groups/<group>/serial.h5`) and B the concurrent burst (every prompt sent at t=0, at most "
    "`conc` in flight, `cells/<cell>/burst.h5`), both sent to the same engine process: same engine, "
    "dtype and prefix-cache setting, so A and B differ in concurrency and, with the cache on, in "
    "which prefixes the engine had already cached (B re-sends prompts that A cached)."
)
PAIR_LEGEND = (
    "Columns: `pos` is the first differing generated position; `gap` is the logprob gap between "
    "the two competing tokens at `pos` in each trace (A: A's token over B's, B: the reverse), in "
    "nats and in ULPs of the run's grid (raw logits); `reused prefix` is each request's reported "
    "`cached_tokens` (-1: not reported; the cell table's `reuse` then gives the engine's /metrics "
    "hit counter over the burst); `drift before` is the max |Δ chosen logprob| before `pos` (nats); "
    "`rule` is why the class applies (docs/analysis.md); `teacher-forced` is the replay cross-check when run."
)


def pitfalls(cells: Iterable[tuple[str, Mapping]]) -> list[str]:
    """One line per pitfall any burst capture warned of (capture/pitfalls.py; the run metadata's
    `pitfalls`), with the cells it applies to. cells: (cell id, its burst facts)."""
    seen: dict[str, tuple[str, list[str]]] = {}
    for cid, facts in cells:
        for p in facts.get("pitfalls") or ():
            seen.setdefault(p["code"], (p["message"], []))[1].append(cid)
    if not seen:
        return []
    out = ["### Pitfalls warned at capture", ""]
    for code, (message, cids) in seen.items():
        where = ", ".join(cids[:4]) + (f" and {len(cids) - 4} more" if len(cids) > 4 else "")
        out.append(f"- `{code}` ({where}): {message}")
    return out + [""]


def reuse(facts: Mapping) -> str:
    """The burst's prefix reuse for the cell table: requests that reported reuse out of the ok
    ones when the engine reports cached tokens per request; else the prompt tokens its /metrics
    hit counter moved over the capture, of those looked up (run.prefix_cache_counters)."""
    if not facts:
        return ""
    if facts.get("cached_reported"):
        return f"{facts['reused']}/{facts['requests']} req"
    c = facts.get("counters") or {}
    if c.get("hits_delta") is None:
        return "?"
    looked = c.get("queries_delta")
    return f"{c['hits_delta']:g}{'' if looked is None else f'/{looked:g}'} tok (/metrics)"


def shards(man: Manifest | None) -> list[str]:
    """A merged run: the shards it holds, and by name every shard and cell that is missing.
    A shard reported alone: which shard of how many."""
    if man is None or (man.merged is None and man.shard is None):
        return []
    if man.merged is None:
        sh = man.shard
        return [
            f"This directory is shard {sh['index']}/{sh['count']} of matrix {man.matrix_name}: "
            f"{len(sh['cells'])} of its {len(sh['matrix_cells'])} cells. Merge the shards with "
            "`tracekit report SHARD_DIR... --out DIR` for the whole matrix.",
            "",
        ]
    m = man.merged
    n = m["count"]
    out = ["### Shards", "", f"Merged from {len(m['shards'])} of {n} shards ({m['assignment']}):", ""]
    for s in m["shards"]:
        state = (
            "complete" if s["complete"] else "**incomplete** (no manifest: killed or failed; rerun it with --resume)"
        )
        host = f", {s['host']}, {s['started_utc']} → {s['finished_utc']}" if s.get("host") else ""
        out.append(f"- shard {s['index']}/{n}: `{s['dir']}`: {len(s['cells'])} cells, {state}{host}")
        if s["missing"]:
            out.append(f"  - missing cells: {', '.join(s['missing'])}")
    for i in m["missing_shards"]:
        cells = m.get("missing_shard_cells", {}).get(str(i), [])
        out.append(f"- **shard {i}/{n}: missing** (not given): its cells {', '.join(cells) or '(none)'}")
    if m["missing_cells"]:
        out += [
            "",
            f"**{len(m['missing_cells'])} cells missing** (counted as failed): " + ", ".join(m["missing_cells"]),
        ]
    return out + [""]


def setup(man: Manifest | None) -> list[str]:
    if man is None:
        return ["(no manifest.json: the run did not finish; setup unknown)", ""]
    host = man.host
    out = [
        "### Setup",
        "",
        f"- tool: {man.tool}, commit `{man.git_commit}`",
        f"- command: `{man.command}`",
        f"- host: {host.get('hostname')} ({host.get('platform')}, {host.get('cpus')} CPUs, "
        f"Python {host.get('python')})",
        f"- run: {man.started_utc} → {man.finished_utc}",
    ]
    for e in man.engines:
        data = (e.self_report.get("v1_models") or {}).get("data") or [{}]
        meta = (data[0] if isinstance(data[0], dict) else {}).get("meta") or {}
        desc = ", ".join(
            f"{k}={meta[k]}"
            for k in ("engine", "version", "dtype", "attn", "slots", "prefix_cache", "inject_fault")
            if k in meta
        )
        cmd = " ".join(e.command or ()) or e.url or ""
        out.append(
            f"- engine `{e.engine_id}`: `{cmd}`"
            + (f" — self-report: {desc}" if desc else "")
            + (f" — **did not start**: {clip(e.error, 200)}" if e.error else "")
        )
    out.append(f"- {len(man.files)} files with sha256 in `manifest.json`")
    return out + [""]


def plot_lines(root: Path, plots: dict | None) -> list[str]:
    if not plots:
        return []
    out = [
        "### Plots",
        "",
        "The plots are PNG files beside this page (`report/` of the run directory). **Attach them** "
        "to the PR or comment (drag the files in): the image links below are relative and show only "
        "where this file is viewed next to them (a repository, a local viewer); they break once pasted.",
        "",
    ]
    for name, rel in plots.items():
        out.append(f"- `{rel}`: ![{name}]({Path(rel).relative_to('report').as_posix()})")
    return out + [""]


def _check(record, name: str):
    return next((c for c in record.checks if c.name == name), None)


def yardstick(root: Path, loaded) -> tuple[list[str], dict]:
    """What each cell was judged with (workflows/judge.py): the calibration records under
    calibration/ (each named by where its healthy repeats came from), and per cell the
    calibration it used (or `uncalibrated`, on the documented defaults) and the reference of each
    verdict: the warm serial baseline (diff.json) and the cold reference (diff-cold.json).
    Returns (the page's lines, summary.json's `yardstick`). A run from before the judged matrix
    has neither: said, not guessed."""
    from tracekit.calibration import read_calibration
    from tracekit.errors import TracekitError

    cals = {}
    for p in sorted((Path(root) / "calibration").glob("*.json")):
        rel = p.relative_to(root).as_posix()
        try:
            cals[rel] = read_calibration(p).describe()
        except TracekitError as e:
            cals[rel] = f"unreadable: {e}"
    cells, rows = {}, []
    for lc in loaded:
        rec = lc.record
        cal, cold = _check(rec, "calibration"), _check(rec, "cold_reference")
        used = cal.evidence.get("calibration") if cal is not None else None
        said = (cal.evidence.get("said") if cal is not None else None) or "not judged (a run from before calibration)"
        cells[rec.cell.id] = {
            "calibration": used,
            "said": said,
            "run_level": None if cal is None else cal.status,
            "references": ["warm serial"] + (["cold"] if cold is not None and cold.status != "skip" else []),
            "cold_reference": None if cold is None else cold.status,
        }
        ref = "warm serial" + (
            f" + cold ({cold.status})"
            if cold is not None and cold.status != "skip"
            else (f" (cold: skip, {cold.summary})" if cold is not None else "")
        )
        rows.append([rec.cell.id, used or "uncalibrated", "—" if cal is None else cal.status, ref, said.split(" (")[0]])
    if not cals and not any(c["run_level"] for c in cells.values()):
        return [], {"calibrations": {}, "cells": cells}
    from tabulate import tabulate

    lines = ["### Yardstick: calibration and references", ""]
    lines += [f"- `{rel}`: {d}" for rel, d in cals.items()] or ["- no calibration record: every cell uncalibrated"]
    lines += [
        "",
        "Each cell's burst is judged against the warm serial baseline (`diff.json`) and, with the prefix cache "
        "on, against the cold reference (`diff-cold.json`: the same prompts serially, the cache reset before each "
        "request), with the calibration below (the run-level flip test: `run-level`); `uncalibrated` cells use the "
        "documented default tolerances (docs/analysis.md).",
        "",
        tabulate(rows, headers=["cell", "calibration", "run-level", "references", "judged with"], tablefmt="github"),
        "",
    ]
    return lines, {"calibrations": cals, "cells": cells}
