"""`tracekit calibrate A.h5 B.h5 [A2.h5 B2.h5 ...] --out cal.json`: one engine's measured noise."""

from __future__ import annotations

import click

EPILOG = """\b
Examples:
  # two healthy runs of the same prompts on the engine under test (e.g. serial twice, burst twice)
  tracekit calibrate serial.h5 serial2.h5 burst.h5 burst2.h5 --out cal-bf16.json
  tracekit diff serial.h5 burst3.h5 --calibration cal-bf16.json
  # with each healthy side's error against the FP32 replay of the A traces' tokens
  tracekit capture --teacher-forced MODEL_DIR --from serial.h5 --history full --dtype fp32 --out ref.h5
  tracekit calibrate serial.h5 burst.h5 --reference ref.h5 --out cal-bf16.json
  tracekit diff serial.h5 burst3.h5 --calibration cal-bf16.json --reference ref.h5
"""


@click.command(epilog=EPILOG)
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The calibration record (JSON).")
@click.option("--name", help="How verdicts name this calibration (default: the file name of --out).")
@click.option("--eos", multiple=True, type=int, help="EOS token id (repeatable), added to the run metadata's.")
@click.option("--tokenizer", type=click.Path(), help="Model/tokenizer directory for EOS ids.")
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False),
    help="A higher-precision replay of the A traces' tokens (as `diff --reference`): each healthy side's "
    "error against it is measured, and `diff --reference` judges 'both far' on it.",
)
@click.option("--reference-select", help="Rows of the reference (default for teacher-forced: history=full,dtype=fp32).")
def cmd(files, out, name, eos, tokenizer, reference, reference_select) -> int:
    """Measure P(flip | top-2 gap) and the drift of healthy repeats of one engine,
    model and dtype: FILES are pairs (A B A2 B2 ...), each two runs that should
    agree. Writes a tracekit.calibration/2 record for `tracekit diff --calibration`.
    Only healthy runs may go in: a calibration of a broken engine excuses its bug."""
    if len(files) % 2:
        raise click.UsageError(f"give traces in pairs (A B [A2 B2 ...]); got {len(files)}")
    from tracekit.analyze.calibrate import default_name, measure
    from tracekit.calibration import write_calibration

    pairs = list(zip(files[0::2], files[1::2]))
    cal = measure(
        pairs,
        name or default_name(out),
        reference=reference,
        reference_select=reference_select,
        eos=eos,
        tokenizer=tokenizer,
    )
    path = write_calibration(cal, out)
    click.echo(f"calibration {cal.describe()}")
    click.echo(_table(cal))
    click.echo(f"written: {path}", err=True)
    return 0


def _table(cal) -> str:
    from tabulate import tabulate

    rows = []
    for bins in (cal.flip_nats, cal.flip_steps):
        if bins is None:
            continue
        e = bins.edges
        for i, (t, f) in enumerate(zip(bins.trials, bins.flips)):
            if t:
                rows.append([bins.unit, f"[{e[i]:g}, {e[i + 1]:g})", t, f, f"{f / t:.3g}"])
    return tabulate(rows, headers=["unit", "top-2 gap", "positions", "flips", "P(flip)"], tablefmt="github")
