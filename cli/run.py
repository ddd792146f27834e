"""`tracekit run MATRIX.toml --out DIR`: run every cell of a matrix (tracekit.workflows.matrix.run),
then write the report (tracekit.analyze.run_report).

Exit 0 when every cell passes, 1 when any cell has an unexplained or
incomparable pair or a failed check, 2 usage, 3 tool error (bad matrix).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

EPILOG = """\b
Examples:
  tracekit run fixtures/matrix/cpu_small.toml --out runs/cpu_small
  tracekit report runs/cpu_small --json
"""


@click.command(epilog=EPILOG)
@click.argument("matrix", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory to create.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON summary (tracekit.matrix-report/1).")
def cmd(matrix, out, as_json) -> int:
    """Run a matrix file (docs/runner.md): per cell a serial baseline, a
    concurrent burst, their diff and lifecycle checks; everything under --out
    with a manifest, and the report in OUT/report/."""
    from tracekit.analyze.run_report import text_table, write_report
    from tracekit.capture.matrix import load_matrix
    from tracekit.workflows.matrix import run

    run(load_matrix(matrix), out)
    report = write_report(out)
    if as_json:
        click.echo(json.dumps(report.summary, indent=1))
    else:
        click.echo(text_table(list(report.rows)))
        t = report.summary["totals"]
        click.echo(f"\n{t['passed']}/{t['cells']} cells pass")
    click.echo(f"report: {Path(out) / 'report' / 'report.md'}", err=True)
    return 1 if report.failed_cells else 0
