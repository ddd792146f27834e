"""Run a matrix: per engine configuration start the engine once, then per
prompt set and output length the serial baseline, then per concurrency the
burst capture and the lifecycle checks. Everything goes under DIR:

    DIR/matrix.toml                       the matrix as read
    DIR/engines/<engine_id>.log|.json     engine output; command line + self-report
    DIR/groups/<group_id>/serial.h5       serial baseline (shared by the group's cells)
    DIR/cells/<cell_id>/burst.h5          concurrent burst capture
    DIR/cells/<cell_id>/checks.json       lifecycle checks (schema tracekit.checks/1)
    DIR/cells/<cell_id>/cell.json         the cell's axes and relative paths

Failures are kept: an engine that does not start fails its cells' checks
(its log stays), a failed request stays a row, a failed check stays failed.
The diff of each cell is not computed here (capture/ never imports analyze):
`tracekit run` does it after `run_matrix` returns.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from tracekit.errors import TracekitError
from tracekit.store import TraceReader

from ..capture_run import CaptureConfig, plan_requests, run_capture
from ..prompts import load_prompts
from . import engines
from .lifecycle import CheckResult, completion_check, lifecycle_checks, metric, metrics_snapshot, prefix_cache_check
from .spec import Cell, Matrix

CHECKS_SCHEMA = "tracekit.checks/1"


@dataclass(frozen=True)
class CellOutcome:
    cell: Cell
    baseline: str | None  # relative to DIR; None when it could not be captured
    burst: str | None
    checks: tuple[CheckResult, ...]

    @property
    def checks_ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def _capture(m: Matrix, url: str, cell: Cell, out: Path, concurrency: int, mode: str):
    """One capture; returns (table or None, error text, planned request count)."""
    s = m.settings
    ps = m.prompt_set(cell.prompts)
    planned = len(load_prompts(ps.path)) * s.repeats
    cfg = CaptureConfig(
        url=url,
        prompts=ps.path,
        out=str(out),
        concurrency=concurrency,
        max_tokens=cell.output_tokens,
        top_logprobs=s.top_logprobs,
        ignore_eos=s.ignore_eos,
        stream=s.stream,
        timeout_s=s.timeout_s,
        repeat=s.repeats,
        progress=False,
        run_meta={
            "cache": "on" if cell.prefix_cache else "off",
            "dtype": cell.dtype,
            "mode": mode,
            "cell": cell.id if mode == "burst" else cell.group_id,
            "matrix": m.name,
        },
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_capture(cfg)
    except TracekitError as e:
        return None, str(e), planned
    with TraceReader(out) as r:
        return r.requests, "", planned


def _specs(m: Matrix, cell: Cell):
    s = m.settings
    cfg = CaptureConfig(
        url="",
        prompts="",
        out="",
        max_tokens=cell.output_tokens,
        top_logprobs=s.top_logprobs,
        ignore_eos=s.ignore_eos,
        stream=s.stream,
    )
    return plan_requests(load_prompts(m.prompt_set(cell.prompts).path), cfg)


def _probe(serial: Path, table, specs) -> tuple[int, dict | None]:
    """The probe for cancel_then_match: the shortest baseline key that reused a prefix
    (most likely to reuse the same prefix again), else the first; and its baseline row."""
    if table is None:
        return 0, None
    index = {s.key: i for i, s in enumerate(specs)}
    rows = [i for i in range(len(table)) if table.status[i] == "ok" and table.key[i] in index]
    if not rows:
        return 0, None
    reused = [i for i in rows if table.cached_tokens[i] > 0]
    row = min(reused, key=lambda i: (table.prompt_len[i], i)) if reused else rows[0]
    with TraceReader(serial) as r:
        ids = r.tokens(row).token_id.tolist()
    return index[table.key[row]], {
        "key": str(table.key[row]),
        "cached_tokens": int(table.cached_tokens[row]),
        "token_ids": ids,
    }


def _run_cell(m: Matrix, eng, cell: Cell, root: Path, base_table, base_err: str, planned: int) -> CellOutcome:
    t0 = time.perf_counter()
    cdir = root / "cells" / cell.id
    hits0 = metric(_snapshot(eng.url), "prefix_cache_hits_total")
    table, err, _ = _capture(m, eng.url, cell, cdir / "burst.h5", cell.concurrency, "burst")
    hits1 = metric(_snapshot(eng.url), "prefix_cache_hits_total")
    specs = _specs(m, cell)
    k = m.settings.cancel_streams or min(cell.concurrency, len(specs))
    probe_i, baseline = _probe(root / "groups" / cell.group_id / "serial.h5", base_table, specs)
    checks = [
        completion_check("completion_serial", base_table, planned, base_err),
        completion_check("completion_burst", table, planned, err),
        prefix_cache_check(table, cell.prefix_cache, None if hits0 is None or hits1 is None else hits1 - hits0),
    ]
    ready = m.target(cell.target).ready_path
    checks += lifecycle_checks(
        eng.url,
        specs,
        probe_i=probe_i,
        baseline=baseline,
        k_cancel=k,
        after_tokens=min(m.settings.cancel_after_tokens, max(1, cell.output_tokens - 1)),
        drain_timeout_s=m.settings.drain_timeout_s,
        timeout_s=m.settings.timeout_s,
        ready_path=ready,
    )
    out = CellOutcome(
        cell,
        f"groups/{cell.group_id}/serial.h5" if base_table is not None else None,
        f"cells/{cell.id}/burst.h5" if table is not None else None,
        tuple(checks),
    )
    _write_outcome(root, out)
    fails = [c.name for c in checks if c.status == "fail"]
    log(
        f"  {cell.id}: {len(checks) - len(fails)}/{len(checks)} checks ok"
        f"{' FAILED ' + ','.join(fails) if fails else ''}"
        f" ({time.perf_counter() - t0:.1f} s)"
    )
    return out


def _snapshot(url: str):
    import asyncio

    return asyncio.run(metrics_snapshot(url)) or {}


def _write_outcome(root: Path, o: CellOutcome) -> None:
    cdir = root / "cells" / o.cell.id
    _write_json(
        cdir / "checks.json", {"schema": CHECKS_SCHEMA, "cell": o.cell.id, "checks": [c.as_dict() for c in o.checks]}
    )
    _write_json(
        cdir / "cell.json",
        {
            **o.cell.as_dict(),
            "baseline": o.baseline,
            "burst": o.burst,
            "checks": f"cells/{o.cell.id}/checks.json",
            "diff": f"cells/{o.cell.id}/diff.json",
        },
    )


def _failed_cells(cells: list[Cell], root: Path, why: str) -> list[CellOutcome]:
    outs = []
    for c in cells:
        o = CellOutcome(c, None, None, (CheckResult("engine_start", "fail", why[:500]),))
        _write_outcome(root, o)
        outs.append(o)
    return outs


def _run_engine(m: Matrix, cells: list[Cell], root: Path, engines_info: dict) -> list[CellOutcome]:
    first = cells[0]
    t = m.target(first.target)
    log(f"engine {first.engine_id}: starting")
    info = {"target": t.name, "kind": t.kind, "log": f"engines/{first.engine_id}.log"}
    engines_info[first.engine_id] = info
    try:
        eng = engines.start(t, first, root / "engines", m.settings.ready_timeout_s)
    except TracekitError as e:
        info.update(error=str(e), command=engines.command_for(t, first))
        _write_json(root / "engines" / f"{first.engine_id}.json", info)
        return _failed_cells(cells, root, f"engine did not start: {e}")
    info.update(
        command=eng.command, url=eng.url, startup_s=round(eng.startup_s, 2), self_report=engines.self_report(eng.url)
    )
    outs = []
    try:
        for gid, group in groupby(cells, key=lambda c: c.group_id):
            group = list(group)
            base, err, planned = _capture(m, eng.url, group[0], root / "groups" / gid / "serial.h5", 1, "serial")
            log(f"  {gid}: serial baseline {'ok' if base is not None else 'FAILED: ' + err}")
            outs += [_run_cell(m, eng, c, root, base, err, planned) for c in group]
    finally:
        info["exit_code"] = eng.stop()
        _write_json(root / "engines" / f"{first.engine_id}.json", info)
    return outs


def run_matrix(m: Matrix, root: str | Path) -> tuple[list[CellOutcome], dict]:
    """Run every cell of m under root; returns the outcomes and the engines' info (for the manifest)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "matrix.toml").write_text(m.text)
    outs, engines_info = [], {}
    for _, cells in groupby(m.cells(), key=lambda c: c.engine_id):
        outs += _run_engine(m, list(cells), root, engines_info)
    return outs, engines_info
