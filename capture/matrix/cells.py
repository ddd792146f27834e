"""Run a matrix: per engine configuration start the engine once, then per
prompt set and output length the serial baseline, then per concurrency the
burst capture and the lifecycle checks. Everything goes under DIR, written
through `tracekit.rundir.RunDir` (layout and records in docs/runner.md).

Failures are kept: an engine that does not start fails its cells' checks
(its log stays), a failed request stays a row, a failed check stays failed.
The diff of each cell is not computed here: `run.py` does it after the captures.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from itertools import groupby
from pathlib import Path

from tracekit.errors import TracekitError
from tracekit.rundir import Cell, CellRecord, Check, EngineRecord, RunDir
from tracekit.store import TraceReader
from tracekit.text import clip

from ..http import CaptureConfig, plan_requests, run_capture
from ..prompts import load_prompts
from . import engines
from .lifecycle import completion_check, lifecycle_checks, reuse_check
from .spec import Matrix


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _capture(m: Matrix, url: str, cell: Cell, out: Path, concurrency: int, mode: str, reset_path: str = ""):
    """One capture; returns (table or None, error text, planned request count, the engine's
    prefix-cache counters around it as the capture recorded them, or None)."""
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
        api_key_env=m.target(cell.target).api_key_env,
        tokenizer=m.target(cell.target).tokenizer,
        eos_token_ids=m.target(cell.target).eos_token_ids,
        progress=False,
        reset_path=reset_path,
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
        return None, str(e), planned, None
    with TraceReader(out) as r:
        return r.requests, "", planned, r.meta.record.prefix_cache_counters


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


def _run_cell(m: Matrix, eng, cell: Cell, rd: RunDir, base_table, base_err: str, planned: int) -> CellRecord:
    t0 = time.perf_counter()
    key = m.target(cell.target).api_key()
    table, err, _, counters = _capture(m, eng.url, cell, rd.path(rd.burst_rel(cell.id)), cell.concurrency, "burst")
    specs = _specs(m, cell)
    k = m.settings.cancel_streams or min(cell.concurrency, len(specs))
    probe_i, baseline = _probe(rd.path(rd.serial_rel(cell.group_id)), base_table, specs)
    checks = [
        completion_check("completion_serial", base_table, planned, base_err),
        completion_check("completion_burst", table, planned, err),
        reuse_check(table, cell.prefix_cache, counters),
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
        api_key=key,
    )
    out = CellRecord(
        cell,
        rd.serial_rel(cell.group_id) if base_table is not None else None,
        rd.burst_rel(cell.id) if table is not None else None,
        tuple(checks),
    )
    rd.write_cell(out)
    fails = [c.name for c in checks if c.status == "fail"]
    log(
        f"  {cell.id}: {len(checks) - len(fails)}/{len(checks)} checks ok"
        f"{' FAILED ' + ','.join(fails) if fails else ''}"
        f" ({time.perf_counter() - t0:.1f} s)"
    )
    return out


def _after_group(m: Matrix, url: str, t, cells: list[CellRecord], rd: RunDir) -> list[CellRecord]:
    """After a group's cells (their bursts and checks, so that they met the cache the serial
    baseline left): the calibration repeats of a healthy target (the group's burst once more at
    each concurrency, `calibration_repeats` times) and, with the prefix cache on, the cold
    reference (serially, the cache reset before each request). A cold reference that cannot be
    captured is a check of each cell (skip or fail, with the reason); the judging is run.py's."""
    first = cells[0].cell
    gid, s = first.group_id, m.settings
    if t.calibrate and s.calibration_repeats:
        for c in sorted({r.cell.concurrency for r in cells}):
            for k in range(1, s.calibration_repeats + 1):
                table, err, _, _ = _capture(m, url, first, rd.path(rd.repeat_rel(gid, c, k)), c, "repeat")
                log(f"  {gid}: calibration repeat c{c} #{k} {'ok' if table is not None else 'FAILED: ' + err}")
    why = None
    if not first.prefix_cache:
        why = ("skip", "prefix cache off: the serial baseline is itself cold")
    elif not s.cold_reference:
        why = ("skip", "cold reference off in the matrix ([run] cold_reference = false)")
    elif not t.reset_path:
        why = ("skip", f"target {t.name} names no reset_path (a route that empties its prefix cache)")
    else:
        table, err, _, _ = _capture(m, url, first, rd.path(rd.cold_rel(gid)), 1, "cold", t.reset_path)
        log(f"  {gid}: cold reference {'ok' if table is not None else 'FAILED: ' + err}")
        if table is None:
            why = ("fail", f"cold reference not captured: {err}"[:500])
    if why is None:
        return cells
    out = [dataclasses.replace(r, checks=(*r.checks, Check("cold_reference", *why))) for r in cells]
    for r in out:
        rd.write_cell(r)
    return out


def _failed_cells(cells: list[Cell], rd: RunDir, why: str) -> list[CellRecord]:
    outs = [CellRecord(c, None, None, (Check("engine_start", "fail", clip(why, 500)),)) for c in cells]
    for o in outs:
        rd.write_cell(o)
    return outs


def _run_engine(m: Matrix, cells: list[Cell], rd: RunDir) -> tuple[list[CellRecord], EngineRecord]:
    first = cells[0]
    t = m.target(first.target)
    log(f"engine {first.engine_id}: starting")
    try:
        eng = engines.start(t, first, rd.root / "engines", m.settings.ready_timeout_s)
    except TracekitError as e:
        rec = engines.failed_record(t, first, str(e))
        rd.write_engine(rec)
        return _failed_cells(cells, rd, f"engine did not start: {e}"), rec
    outs, exit_code = [], None
    try:
        for gid, group in groupby(cells, key=lambda c: c.group_id):
            group = list(group)
            serial = rd.path(rd.serial_rel(gid))
            base, err, planned, _ = _capture(m, eng.url, group[0], serial, 1, "serial")
            log(f"  {gid}: serial baseline {'ok' if base is not None else 'FAILED: ' + err}")
            cells_ = [_run_cell(m, eng, c, rd, base, err, planned) for c in group]
            outs += _after_group(m, eng.url, t, cells_, rd) if base is not None else cells_
    finally:
        exit_code = eng.stop()
        rec = eng.record(t, exit_code)
        rd.write_engine(rec)
    return outs, rec


def run_matrix(m: Matrix, rd: RunDir, cells: list[Cell] | None = None) -> tuple[list[CellRecord], list[EngineRecord]]:
    """Run every cell of m (or only `cells`, in matrix order: a shard, or what a resume reruns)
    into rd (created by the caller); returns the cells' records and the engines' records.
    Diffs are not computed here (see run.py)."""
    outs, recs = [], []
    for _, cells in groupby(m.cells() if cells is None else cells, key=lambda c: c.engine_id):
        o, r = _run_engine(m, list(cells), rd)
        outs += o
        recs.append(r)
    return outs, recs
