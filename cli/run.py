"""`tracekit run MATRIX.toml --out DIR [--shard I/N] [--resume]`: run every cell of a matrix (or of
one shard of it) (tracekit.workflows.matrix.run), then write the report (tracekit.analyze.run_report).

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
  tracekit run M.toml --out runs/m.$SLURM_ARRAY_TASK_ID --shard $SLURM_ARRAY_TASK_ID/8
  tracekit report runs/m.* --out runs/m              # merge the shards, one report
"""


def _shard(ctx, param, value):
    if value is None:
        return None
    from tracekit.errors import ConfigError
    from tracekit.rundir.shards import parse_shard

    try:
        return parse_shard(value)
    except ConfigError as e:
        raise click.BadParameter(
            str(e).removeprefix(f"--shard {value!r}: ").removeprefix(f"--shard {value}: ")
        ) from None


@click.command(epilog=EPILOG)
@click.argument("matrix", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory to create.")
@click.option(
    "--shard",
    metavar="I/N",
    callback=_shard,
    help="Run only shard I of N (0..N-1): the cells whose calibration unit (engine configuration) "
    "hashes to I (docs/runner.md).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="--out is an unfinished run of this matrix (and shard): keep its finished cells, rerun the rest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON summary (tracekit.matrix-report/1).")
def cmd(matrix, out, shard, resume, as_json) -> int:
    """Run a matrix file (docs/runner.md): per cell a serial baseline, a
    concurrent burst, their diff and lifecycle checks; everything under --out
    with a manifest, and the report in OUT/report/. With --shard I/N only one
    shard's cells (merge the shards with `tracekit report DIR... --out DIR`)."""
    from tracekit.analyze.run_report import text_table, write_report
    from tracekit.capture.matrix import load_matrix
    from tracekit.workflows.matrix import run

    res = run(load_matrix(matrix), out, shard=shard, resume=resume)
    if not res.cells:
        click.echo(f"shard {shard.label}: no cell of the matrix falls in this shard; nothing ran", err=True)
        return 0
    report = write_report(out)
    if as_json:
        click.echo(json.dumps(report.summary, indent=1))
    else:
        click.echo(text_table(list(report.rows)))
        t = report.summary["totals"]
        click.echo(f"\n{t['passed']}/{t['cells']} cells pass" + (f" (shard {shard.label})" if shard else ""))
    click.echo(f"report: {Path(out) / 'report' / 'report.md'}", err=True)
    return 1 if report.failed_cells else 0
