"""The yardstick of a matrix run (`tracekit run`, `tracekit demo`): each cell judged with a
calibration measured on healthy repeats, against the warm serial baseline and a cold reference.

- **Calibration** (`calibrate_engines`): per engine configuration of a target that may calibrate
  (`calibrate`, default true except a `serve` target with `--inject-fault`), the pairs (serial
  baseline, calibration repeat) of each of its groups (the repeats are the group's burst once
  more at each concurrency, captured after the cells: `groups/<gid>/repeat-c<N>-<k>.h5`) measured
  by `tracekit.analyze.calibrate.measure` into `calibration/<engine_id>.json`. The judged bursts
  never go into it. The record's name says where the repeats came from.
- **Which calibration a cell uses** (`yardstick`): its own engine configuration's; a cell of a
  target that may not calibrate (a fault target) borrows that of another target with the same
  dtype and cache setting, and says so; else it is judged uncalibrated on the documented
  defaults, and says so.
- **Checks** (`judge_cell`, appended to the cell's lifecycle checks): `calibration` — the
  run-level flip-rate test against that calibration (and the run-level test against the FP32
  teacher-forced reference where the run has one), pass / fail, or skip when uncalibrated;
  `cold_reference` — the burst diffed against the cold reference (`groups/<gid>/cold.h5`: the
  prompts serially with the prefix cache reset before each request; `cells/<id>/diff-cold.json`),
  which catches deterministic cache corruption the warm serial baseline shares with the burst
  (a prefix-cache key collision serves both the same wrong blocks: "identical").
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tracekit.calibration import Calibration, write_calibration
from tracekit.capture.matrix.cells import log
from tracekit.capture.matrix.spec import Matrix
from tracekit.errors import TracekitError
from tracekit.rundir import Cell, CellRecord, Check, RunDir

UNCALIBRATED = "uncalibrated: judged on the documented default tolerances (docs/analysis.md)"
REFERENCE_WARM = "warm serial baseline (the same engine, its prefix cache as the earlier requests left it)"
REFERENCE_COLD = "cold reference (the same engine, prefix cache reset before each request)"


@dataclass(frozen=True)
class Yardstick:
    """What a cell is judged with: a calibration (None: uncalibrated) and how to say it."""

    calibration: Calibration | None
    path: str | None  # relative to DIR
    said: str  # "calibration <name>: ..." or "uncalibrated: ..."


def _exists(rd: RunDir, rel: str | None) -> bool:
    return rel is not None and rd.path(rel).is_file()


def calibrate_engines(rd: RunDir, m: Matrix, records: list[CellRecord]) -> dict[str, Yardstick]:
    """engine id -> its calibration, for every engine configuration with calibration repeats."""
    from tracekit.analyze.calibrate import measure

    out: dict[str, Yardstick] = {}
    for engine_id in dict.fromkeys(r.cell.engine_id for r in records):
        rs = [r for r in records if r.cell.engine_id == engine_id]
        target = m.target(rs[0].cell.target)
        if not target.calibrate or not m.settings.calibration_repeats:
            continue
        pairs, levels, groups = [], set(), set()
        for r in rs:
            if r.baseline is None:
                continue
            for k in range(1, m.settings.calibration_repeats + 1):
                rel = rd.repeat_rel(r.cell.group_id, r.cell.concurrency, k)
                if _exists(rd, rel) and (r.baseline, rel) not in pairs:
                    pairs.append((r.baseline, rel))
                    levels.add(r.cell.concurrency)
                    groups.add(r.cell.prompts)
        if not pairs:
            continue
        cs = ",".join(f"c{c}" for c in sorted(levels))
        name = (
            f"{engine_id}: healthy repeats of target {target.name} (serial baseline vs a repeat burst {cs}, "
            f"{len(groups)} prompt set(s), {len(pairs)} trace pairs; the judged bursts left out)"
        )
        try:
            cal = measure([(str(rd.path(a)), str(rd.path(b))) for a, b in pairs], name)
        except TracekitError as e:
            log(f"calibration {engine_id}: not measured: {e}")
            continue
        root = str(rd.root)
        srcs = tuple({**s, "a": os.path.relpath(s["a"], root), "b": os.path.relpath(s["b"], root)} for s in cal.sources)
        cal = dataclasses.replace(cal, sources=srcs)
        rel = rd.calibration_rel(engine_id)
        write_calibration(cal, rd.path(rel))
        log(f"calibration -> {rel}: {cal.describe()}")
        out[engine_id] = Yardstick(cal, rel, f"calibration {cal.name}")
    return out


def yardstick(m: Matrix, cell: Cell, cals: dict[str, Yardstick]) -> Yardstick:
    """The calibration a cell is judged with (see the module docstring)."""
    t = m.target(cell.target)
    if t.calibrate:
        own = cals.get(cell.engine_id)
        if own is not None:
            return own
        why = "no calibration repeats of this engine configuration" + (
            "" if m.settings.calibration_repeats else " ([run] calibration_repeats = 0)"
        )
        return Yardstick(None, None, f"{UNCALIBRATED}: {why}")
    for o in m.targets:  # the first healthy target, in matrix order, of the same dtype and cache setting
        ys = cals.get(dataclasses.replace(cell, target=o.name).engine_id) if o.name != t.name else None
        if ys is not None:
            return Yardstick(
                ys.calibration,
                ys.path,
                f"{ys.said} (borrowed: target {t.name} may not calibrate itself — a fault target's repeats "
                "would excuse its bug)",
            )
    return Yardstick(
        None,
        None,
        f"{UNCALIBRATED}: target {t.name} may not calibrate itself and no healthy target of the same "
        "dtype and cache setting ran",
    )


def diff_doc(a: Path, b: Path, ys: Yardstick, teacher: Path | None = None, reference: bool = False) -> dict:
    """tracekit.diff of B against A with the cell's calibration (and the teacher-forced trace as the
    cross-check, and as the FP32 reference when `reference`)."""
    from tracekit.analyze import diff

    res = diff(a, b, teacher=teacher, calibration=ys.calibration, reference=teacher if reference else None)
    doc = res.to_json()
    doc["yardstick"] = {"calibration": ys.path, "said": ys.said}
    doc["ok"] = res.ok
    return doc


def _read(rd: RunDir, rel: str | None) -> dict | None:
    try:
        return json.loads(rd.path(rel).read_text(encoding="utf-8")) if rel else None
    except (OSError, ValueError):
        return None


def _calibration_check(rd: RunDir, r: CellRecord, ys: Yardstick) -> Check | None:
    doc = _read(rd, r.diff.path)
    if doc is None:
        return None
    flip, ref = doc.get("calibration"), doc.get("reference")
    notes = [n for n in doc.get("notes", ()) if n.startswith(("run-level flip test", "reference "))]
    ev = {"calibration": ys.path, "said": ys.said, "flip_test": flip, "reference": ref and ref.get("run")}
    ok = (flip is None or flip.get("ok", True)) and (ref is None or ref.get("run", {}).get("ok", True))
    if flip is None and ref is None:
        return Check("calibration", "skip", f"{ys.said}; no run-level test", ev)
    head = ys.said if flip is None else f"judged with {ys.said}"
    return Check("calibration", "pass" if ok else "fail", "; ".join([head, *notes])[:1500], ev)


def cold_check(rd: RunDir, r: CellRecord, ys: Yardstick) -> tuple[Check | None, dict | None]:
    """The burst against the cold reference: (the check, the diff document), or (None, None)
    when the group has no cold reference (its reason is already a check of the cell)."""
    cold = rd.cold_rel(r.cell.group_id)
    if r.burst is None or not _exists(rd, cold):
        return None, None
    try:
        doc = diff_doc(rd.path(cold), rd.path(r.burst), ys)
    except TracekitError as e:
        return Check("cold_reference", "fail", f"diff against the cold reference failed: {e}"[:500]), None
    rel = rd.write_diff(r.cell.id, doc, cold, r.burst, cold=True).path
    s = doc["summary"]
    bad = [p["key"] for p in doc["pairs"] if p["class"] in ("unexplained", "incomparable")]
    line = f"burst vs the {REFERENCE_COLD}: {s['identical']}/{s['pairs']} identical" + "".join(
        f", {s[k]} {k}" for k in s if k not in ("pairs", "identical") and s[k]
    )
    if bad:
        line += f"; failing: {', '.join(bad[:8])}"
        warm = {p["key"]: p["class"] for p in (_read(rd, r.diff.path) or {}).get("pairs", ())}
        hidden = [k for k in bad if warm.get(k) == "identical"]
        if hidden:
            line += (
                f" ({', '.join(hidden[:8])} identical against the warm serial baseline: it met the same cache "
                "state as the burst)"
            )
    flip = doc.get("calibration")
    if flip is not None and not flip.get("ok", True):
        line += "; run-level flip test NOT consistent with the calibration"
    ev = {"diff": rel, "reference": cold, "summary": s, "failing": bad, "calibration": ys.path}
    return Check("cold_reference", "pass" if doc["ok"] else "fail", f"{line} (judged with {ys.said})"[:1500], ev), doc


def judge_cell(rd: RunDir, r: CellRecord, ys: Yardstick) -> CellRecord:
    """The cell with its `calibration` and `cold_reference` checks appended (see the docstring)."""
    checks = [c for c in r.checks if c.name not in ("calibration",)]
    cal = _calibration_check(rd, r, ys)
    if cal is not None:
        checks.append(cal)
    cold, _ = cold_check(rd, r, ys)
    if cold is not None:
        checks.append(cold)
    return dataclasses.replace(r, checks=tuple(checks))


def cell_calibration(rd: RunDir, cell_id: str) -> str | None:
    """The calibration record a judged cell used (its `calibration` check), as a path, or None."""
    r = rd.read_cell(cell_id)
    for c in r.checks:
        if c.name in ("calibration", "cold_reference") and c.evidence.get("calibration"):
            p = rd.path(c.evidence["calibration"])
            return str(p) if p.is_file() else None
    return None
