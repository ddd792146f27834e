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
  tracekit report runs/shard-0 runs/shard-1 runs/shard-2 --out runs/merged   # shards of one matrix
"""


@click.command(epilog=EPILOG)
@click.argument("directories", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Merge the shard directories given (`tracekit run --shard I/N`) into this new run directory, and report it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (tracekit.matrix-report/1).")
@click.option(
    "--pair",
    metavar="CELL:KEY",
    help="Pair for the logprob drift plot (default: the first unexplained, else the latest benign divergence).",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def cmd(directories, out, as_json, pair, no_plots) -> int:
    """Write DIR/report/report.md (paste-ready for a PR), summary.json and
    plots (classes.png, gaps.png, drift.png); print the markdown (or --json).
    With several shard directories and --out: merge them into --out first (one
    matrix, one tracekit version; missing shards and cells are named, and fail).
    Exit 1 when any cell fails (unexplained / incomparable pairs, failed checks)."""
    from tracekit.analyze.run_report import write_report

    if len(directories) > 1 and not out:
        raise click.UsageError("several directories: give --out DIR, the new run directory that merges these shards")
    directory = directories[0]
    if out:
        from tracekit.rundir.merge import MergeRefused, merge
        from tracekit.runinfo import command_line

        try:
            merged = merge(list(directories), out, command_line(None))
        except MergeRefused as e:
            raise click.UsageError(str(e)) from None
        for s in merged.shards:
            if not s.complete:
                click.echo(f"warning: shard {s.index}/{merged.count} ({s.dir}) has no manifest: it did not finish; "
                           f"{len(s.missing)} of its cells missing", err=True)  # fmt: skip
        if merged.missing_shards:
            names = ", ".join(f"{i}/{merged.count}" for i in merged.missing_shards)
            click.echo(f"warning: shards missing: {names}; {len(merged.missing_cells)} cells missing", err=True)
        directory = out

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
