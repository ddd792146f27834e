"""`tracekit demo`: the whole method on the embedded default, one command.

Runs fixtures/matrix/demo.toml (the reference engine with the tiny fixture
model; FP32 and BF16 with prefix reuse; serial baseline vs concurrent bursts)
with the teacher-forced replay of every divergent key, writes the report, and
prints the evidence (also kept as DIR/report/demo_stdout.txt).

Exit 0 when it ran and the FP32 controls are N/N identical with every cell
passing: BF16 divergences are the expected finding, not a failure. Exit 1
(loudly) when an FP32 control diverges, or a cell fails.
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

import click

from ..runinfo import REPO_ROOT

MATRIX = REPO_ROOT / "fixtures" / "matrix" / "demo.toml"
EPILOG = """\b
Examples:
  tracekit demo                      # everything under traces/demo-<timestamp>/
  tracekit demo --out traces/demo
"""


@click.command(epilog=EPILOG)
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default traces/demo-<UTC timestamp>).")
def cmd(out) -> int:
    """Start the reference engine with the fixture model, capture serial and
    concurrent runs in FP32 and BF16 with prefix reuse, run the teacher-forced
    diagnostic on the divergent keys, diff, and print the evidence table."""
    from analyze.demo_report import demo_page, demo_verdict, write_demo_page
    from analyze.matrix_report import diff_document, write_report
    from capture.matrix import TeacherPlan, load_matrix, run

    t0 = time.perf_counter()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(out or f"traces/demo-{stamp}")
    click.echo(f"tracekit demo: running {MATRIX.relative_to(REPO_ROOT)} into {root}/", err=True)
    run(load_matrix(MATRIX), root, diff_document, teacher=TeacherPlan())
    report = write_report(root)
    verdict = demo_verdict(list(report.rows))
    page = demo_page(report, verdict, time.perf_counter() - t0)
    write_demo_page(report, page)
    click.echo(page)
    if not verdict.ok:
        click.echo("tracekit demo: FAILED (see the FAIL lines above)", err=True)
    return 0 if verdict.ok else 1
