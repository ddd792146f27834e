"""What `tracekit demo` concludes and prints: the FP32-control verdict and the demo's page.

The demo's premise: FP32 serial vs concurrent must be N/N identical (the
control); BF16 divergences classified benign are the finding, not a failure.
`demo_verdict` checks that; `demo_page` is the text the demo prints and keeps
as `report/demo_stdout.txt` beside the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .matrix_report import CellRow, Report, pair_table, text_table

BENIGN = ("bf16_tie_flip", "cache_boundary", "post_eos")
STDOUT_FILE = "demo_stdout.txt"


@dataclass(frozen=True)
class DemoVerdict:
    ok: bool
    lines: tuple[str, ...]  # the FP32-control line, the BF16 line, any FAIL line


def demo_verdict(rows: list[CellRow]) -> DemoVerdict:
    """The FP32 controls must be N/N and every cell must pass; BF16 divergences are reported."""
    lines, ok = [], True
    fp32 = [r for r in rows if r.cell.dtype == "fp32"]
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
    bf = [r for r in rows if r.cell.dtype != "fp32" and r.diff]
    counts = {k: sum(r.diff.counts[k] for r in bf) for k in (*BENIGN, "unexplained", "incomparable")}
    pairs = sum(r.diff.n_pairs for r in bf)
    div = pairs - sum(r.diff.identical for r in bf)
    lines.append(
        f"BF16: {div} of {pairs} pairs diverge: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + ". Benign BF16 divergences are the expected finding, not a failure."
    )
    bad = [r.cell.id for r in rows if not r.ok]
    if bad:
        ok = False
        lines.append(f"FAIL: {len(bad)} cell(s) with unexplained/incomparable pairs or failed checks: {', '.join(bad)}")
    return DemoVerdict(ok, tuple(lines))


def demo_page(report: Report, verdict: DemoVerdict, seconds: float) -> str:
    """The demo's stdout: the evidence table, every divergent pair, the verdict, where the files are."""
    root = report.root
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
            *verdict.lines,
            "",
            f"files: {root}/ (manifest.json with sha256 of every file; groups/*/serial.h5, cells/*/burst.h5, "
            "diff.json, checks.json, teacher.h5; engines/*.log)",
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
