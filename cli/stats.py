"""`tracekit stats RUN.h5 [...]`: reproducibility over repeats of the same prompts."""

from __future__ import annotations

import json

import click

EPILOG = """\b
Examples:
  tracekit capture --http URL --prompts P.jsonl --repeat 200 --concurrency 8 --out run.h5
  tracekit stats run.h5 --plot stats.png
  tracekit stats run.h5 --reference r0 --json
  tracekit stats runs/merged                     # a run directory: per group, serial + bursts pooled
"""


@click.command(epilog=EPILOG)
# FILES: no click exists-check, so a missing file gets the readers' one-line error (exit 3), as in diff and inspect
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema tracekit.percentiles/1).")
@click.option(
    "--reference",
    type=click.Choice(["mode", "r0"]),
    default="mode",
    show_default=True,
    help="What each completion is compared with: the most common completion of its prompt, or repeat 0.",
)
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: first-split histogram, flip rate by gap.")
def cmd(files, as_json, reference, plot) -> int:
    """Over K repeats of each prompt (`tracekit capture --repeat K`, keys id#r<k>; rows of
    one prompt are pooled across FILES): unique completions per prompt, where they first
    split from the reference, and the flip rate as a function of the reference's top-2 gap
    at that position. With one `tracekit run` directory (a merged one too): the same per
    serial-baseline group, its serial capture and its bursts pooled as repeats.
    Exit 0 when it ran (a split is the finding, not a failure)."""
    from pathlib import Path

    from tracekit.analyze.repeats import reproducibility, run_groups
    from tracekit.analyze.repeats_report import plot as plot_png
    from tracekit.analyze.repeats_report import text_report

    if any(Path(f).is_dir() for f in files):
        if len(files) > 1 or plot:
            raise click.UsageError("a run directory is given alone (no other FILES, no --plot)")
        groups = [(gid, reproducibility(paths, reference=reference)) for gid, paths in run_groups(files[0])]
        if as_json:
            doc = {"schema": "tracekit.stats-run/1", "dir": files[0]}
            doc["groups"] = [{"group": gid, **r.to_json()} for gid, r in groups]
            click.echo(json.dumps(doc, indent=1))
        else:
            click.echo("\n\n".join(f"## group {gid} ({len(r.paths)} traces)\n\n{text_report(r)}" for gid, r in groups))
        return 0

    result = reproducibility(list(files), reference=reference)
    if plot:
        plot_png(result, plot)
        click.echo(f"plot: {plot}", err=True)
    if as_json:
        doc = result.to_json()
        doc["plot"] = plot
        click.echo(json.dumps(doc, indent=1))
    else:
        click.echo(text_report(result))
    return 0
