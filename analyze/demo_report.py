"""What `tracekit demo` concludes and prints: the controls' verdict and the demo's page.

The demo's premise: FP32 serial vs concurrent must be N/N identical (the
control), and so must BF16 on the deterministic (`--batch-invariant`) engine,
bitwise; BF16 divergences classified benign are the finding, not a failure,
and `tracekit explain` names the cause of each, judged with the calibration
the run measured on the engine's healthy repeats. A pair explain calls `bug`
(LOUD when its class was benign) or `unresolved` fails the demo, as it makes
`tracekit explain` exit 1. `demo_verdict` checks that; `demo_page` is the text
the demo prints and keeps as `report/demo_stdout.txt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tracekit.verdicts import BENIGN as _BENIGN

from . import explain_cells
from .explain_cells import CellCauses
from .run_report import CellRow, Report, pair_table, text_table
from .run_report_sections import yardstick

BENIGN = tuple(v.value for v in _BENIGN)  # tracekit/verdicts.py
STDOUT_FILE = "demo_stdout.txt"


@dataclass(frozen=True)
class DemoVerdict:
    ok: bool
    lines: tuple[str, ...]  # the FP32-control line, the BF16 line, any FAIL line


def bitwise(root: Path, row: CellRow) -> int | None:
    """How many of the cell's pairs are bitwise equal (diff.json's `bitwise`); None without a diff."""
    rel = row.loaded.record.diff.path if row.loaded.record.diff else None
    if rel is None or row.diff is None:
        return None
    try:
        pairs = json.loads((Path(root) / rel).read_text(encoding="utf-8"))["pairs"]
    except (OSError, ValueError, KeyError):
        return None
    return sum(bool(p.get("bitwise")) for p in pairs)


def _deterministic(rows: list[CellRow], root: Path | None) -> tuple[bool, str]:
    """The batch-invariant rows must be N/N identical and bitwise (when root gives the diffs)."""
    same = sum(r.diff.identical for r in rows if r.diff)
    total = sum(r.diff.n_pairs for r in rows if r.diff)
    bits = [bitwise(root, r) for r in rows] if root is not None else [None]
    bit = None if None in bits else sum(bits)
    names = ", ".join(dict.fromkeys(r.cell.target for r in rows))
    ok = all(r.diff is not None and r.diff.identical == r.diff.n_pairs for r in rows) and bit in (None, total)
    bw = "" if bit is None else f", {bit}/{total} bitwise"
    if not ok:
        return False, (
            f"FAIL: the deterministic configuration ({names}, --batch-invariant) is NOT N/N: {same}/{total} "
            f"identical{bw}. Its results must not depend on the batch."
        )
    return True, (
        f"Deterministic configuration ({names}, --batch-invariant), BF16: {same}/{total} identical{bw} across "
        f"{len(rows)} cells (N/N, as required): computing each row as if alone removes the batch-composition flips."
    )


def demo_verdict(
    rows: list[CellRow], deterministic: tuple[str, ...] = (), root: Path | None = None, causes=()
) -> DemoVerdict:
    """The FP32 controls and the deterministic target's cells (`deterministic`: target names) must
    be N/N (bitwise for the latter, read from root's diffs) and every cell must pass; the other
    BF16 divergences are reported, and the causes `tracekit explain` found (LOUD ones flagged)."""
    lines, ok = [], True
    det = [r for r in rows if r.cell.target in deterministic]
    rows_main = [r for r in rows if r.cell.target not in deterministic]
    fp32 = [r for r in rows_main if r.cell.dtype == "fp32"]
    same = sum(r.diff.identical for r in fp32 if r.diff)
    total = sum(r.diff.n_pairs for r in fp32 if r.diff)
    if not fp32 or any(r.diff is None or r.diff.identical != r.diff.n_pairs for r in fp32):
        ok = False
        lines.append(
            f"FAIL: FP32 control is NOT N/N: {same}/{total} identical. FP32 serial vs concurrent must "
            "agree exactly; this engine or machine breaks the demo's premise."
        )
    else:
        lines.append(f"FP32 control: {same}/{total} identical across {len(fp32)} cells (N/N, as required).")
    bf = [r for r in rows_main if r.cell.dtype != "fp32" and r.diff]
    counts = {k: sum(r.diff.counts[k] for r in bf) for k in (*BENIGN, "unexplained", "incomparable")}
    pairs = sum(r.diff.n_pairs for r in bf)
    div = pairs - sum(r.diff.identical for r in bf)
    lines.append(
        f"BF16: {div} of {pairs} pairs diverge: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + ". Benign BF16 divergences are the expected finding, not a failure."
    )
    if det:
        det_ok, line = _deterministic(det, root)
        ok &= det_ok
        lines.append(line)
    if causes:
        lines.append(f"Causes ({explain_cells.headline(list(causes))}).")
        lines += explain_cells.loud_lines(list(causes))
        bad = [
            f"{cc.cell.id}:{p['key']} ({p['kind']})"
            for cc in causes
            for p in cc.pairs
            if p.get("kind") not in explain_cells.OK_KINDS or p.get("loud")
        ]
        bad += [f"{cc.cell.id}: {cc.error}" for cc in causes if cc.error]
        if bad:
            ok = False
            lines.append(
                f"FAIL: {len(bad)} explained pair(s) with no cause — `bug` (report as a bug) or `unresolved`, on "
                f"which `tracekit explain` exits 1, and so does the demo: {', '.join(bad)}"
            )
    bad = [r.cell.id for r in rows if not r.ok]
    if bad:
        ok = False
        lines.append(f"FAIL: {len(bad)} cell(s) with unexplained/incomparable pairs or failed checks: {', '.join(bad)}")
    return DemoVerdict(ok, tuple(lines))


def _causes_block(causes: list[CellCauses], sampled: str) -> list[str]:
    if not causes:
        return ["Cause of each flip: no cell was explained (no divergent pair)", ""]
    return [
        f"Cause of each flip (tracekit explain, {sampled}; A = serial baseline, B = burst; right side = the "
        "side the FP32 configuration's alone runs agree with):",
        "",
        *explain_cells.text_lines(causes),
        "",
    ]


def demo_page(
    report: Report, verdict: DemoVerdict, seconds: float, causes: list[CellCauses] = (), sampled: str = ""
) -> str:
    """The demo's stdout: the evidence table, every divergent pair and its cause, the yardstick
    (the calibrations and references each cell was judged with), the verdict, where the files are.
    `sampled` says what the explain step ran (repeats, configurations)."""
    root = report.root
    yard, _ = yardstick(root, [r.loaded for r in report.rows])
    plots = ", ".join(str(root / p) for p in report.plots.values()) or "none"
    return "\n".join(
        [
            "tracekit demo: reference engine (tiny fixture model, CPU); serial baseline vs concurrent burst, "
            "FP32 and BF16, prefix cache on",
            "",
            text_table(list(report.rows)),
            "",
            "Divergent pairs (A = serial baseline, B = concurrent burst; gaps in ULPs of the raw logits; "
            "teacher-forced = does a cache history or dtype reproduce the flip):",
            "",
            pair_table(list(report.rows)),
            "",
            *_causes_block(list(causes), sampled),
            *[x.removeprefix("### ") for x in yard],
            *verdict.lines,
            "",
            f"files: {root}/ (manifest.json with sha256 of every file; groups/*/serial.h5, cold.h5 (the cold "
            "reference), repeat-*.h5 (calibration repeats); calibration/*.json; cells/*/burst.h5, diff.json, "
            "diff-cold.json, checks.json, teacher.h5, explain/ (variants-*.h5, explain.json); engines/*.log)",
            f"report: {root / 'report' / 'report.md'} (this text: {root / 'report' / STDOUT_FILE})",
            f"plots: {plots}",
            f"took {seconds:.0f} s",
        ]
    )


def write_demo_page(report: Report, text: str) -> Path:
    """Keep the demo's stdout beside the report (the README points at it)."""
    path = report.root / "report" / STDOUT_FILE
    path.write_text(text + "\n")
    return path
