"""`tracekit demo`: the whole method on the embedded default, one command (tracekit.workflows.demo).

Exit 0 when it ran, the FP32 controls and the deterministic cells are N/N identical,
every cell passes and explain gives every divergent pair a cause (BF16 divergences are
the expected finding, not a failure); exit 1 (loudly) when a control diverges, a cell
fails, explain calls a pair `bug` or `unresolved` (as `tracekit explain` exits 1 on it)
or the explain step could not run.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import click

from tracekit.workflows.demo import REPEATS

EPILOG = """\b
Examples:
  tracekit demo                      # everything under traces/demo-<timestamp>/
  tracekit demo --out traces/demo --repeats 5
"""


@click.command(epilog=EPILOG)
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default traces/demo-<UTC timestamp>).")
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=REPEATS,
    show_default=True,
    help="Runs of each explain variant on the cell's configuration (1 on the deterministic and FP32 ones).",
)
def cmd(out, repeats) -> int:
    """Start the reference engine with the fixture model, capture serial and
    concurrent runs in FP32 and BF16 with prefix reuse (and BF16 with
    --batch-invariant), a calibration repeat of each burst and a cold reference,
    run the teacher-forced diagnostic on the divergent keys, diff with each
    engine's calibration, explain each flip on live engines, and print the
    evidence table, the causes and the calibrations used. Exit 1 when a control
    diverges, a cell fails, or explain calls a pair `bug` or `unresolved` (the
    lines on which `tracekit explain` exits 1)."""
    from tracekit.workflows.demo import run_demo

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    result = run_demo(Path(out or f"traces/demo-{stamp}"), repeats)
    click.echo(result.page)
    if not result.ok:
        click.echo("tracekit demo: FAILED (see the FAIL lines above)", err=True)
    return 0 if result.ok else 1
