"""`tracekit report DIR`: the full-matrix evidence of a `tracekit run` directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

EPILOG = """\b
Examples:
  tracekit report runs/cpu_small                 # markdown table on stdout, files in DIR/report/
  tracekit report runs/cpu_small --json
  tracekit report runs/cpu_small --pair ref.bf16.cache-on.cpu_small.out32.c8:c3
"""


@click.command(epilog=EPILOG)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (tracekit.matrix-report/1).")
@click.option(
    "--pair",
    metavar="CELL:KEY",
    help="Pair for the logprob drift plot (default: the first unexplained, else the latest benign divergence).",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def cmd(directory, as_json, pair, no_plots) -> int:
    """Write DIR/report/report.md (paste-ready for a PR), summary.json and
    plots (classes.png, gaps.png, drift.png); print the markdown (or --json).
    Exit 1 when any cell fails (unexplained / incomparable pairs, failed checks)."""
    from tracekit.analyze.run_report import write_report

    sel = None
    if pair:
        cell, sep, key = pair.rpartition(":")
        if not sep or not cell or not key:
            raise click.BadParameter(f"{pair!r}: expected CELL:KEY", param_hint="--pair")
        sel = (cell, key)
    report = write_report(directory, sel, plots=not no_plots)
    click.echo(json.dumps(report.summary, indent=1) if as_json else report.markdown)
    out = Path(directory) / "report"
    click.echo(
        f"report: {out / 'report.md'}; summary: {out / 'summary.json'}; plots: "
        + (", ".join(str(Path(directory) / p) for p in report.plots.values()) or "none"),
        err=True,
    )
    return 1 if report.failed_cells else 0
