"""`tracekit diff A B [C ...]`: classify every request's divergence from A."""

from __future__ import annotations

import json

import click

from tracekit.analyze.classify import CLASSES as CLASS_NAMES  # light: numpy and the store, no torch
from tracekit.analyze.classify import DEFAULTS

EPILOG = """\b
Examples:
  tracekit diff serial.h5 concurrent.h5
  tracekit diff serial.h5 concurrent.h5 --markdown --only unexplained
  tracekit diff http.h5 diag.h5 --b-select history=full,dtype=fp32 --json
  tracekit diff serial.h5 prefix_on.h5 --teacher-forced diag.h5
  tracekit diff vllm_a.h5 vllm_b.h5 --dtype bf16 --tokenizer ./model   # metadata without dtype / EOS
  tracekit diff serial.h5 burst.h5 --calibration cal-bf16.json          # the run's flips vs this engine's noise
  tracekit diff serial.h5 burst.h5 --reference diag.h5                  # each side vs the FP32 teacher-forced replay
"""


def _per_dtype(field: str) -> str:
    return "default per dtype: " + ", ".join(f"{d} {getattr(t, field):g}" for d, t in DEFAULTS.items())


def _tol_option(name: str, field: str, what: str):
    return click.option(name, field, type=float, default=None, help=f"{what} ({_per_dtype(field)}).")


@click.command(epilog=EPILOG)
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema tracekit.diff/2).")
@click.option("--markdown", is_flag=True, help="Print a markdown block to paste into a pull request.")
@_tol_option("--tie-ulps", "tie_ulps", "Tie tolerance in steps of the run's grid, from raw logits")
@_tol_option("--drift-ulps", "drift_ulps", "Movement / cache_boundary tolerance in grid steps, from raw logits")
@_tol_option("--tie-nats", "tie_nats", "Tie tolerance in nats, traces with logprobs only")
@_tol_option("--drift-nats", "drift_nats", "Max |Δ chosen logprob| before the difference; movement in nats")
@_tol_option("--drift-mean-nats", "drift_mean_nats", "Mean |Δ chosen logprob| bound (one spike allowed)")
@click.option(
    "--grid-floor", type=float, default=1.0, show_default=True, help="The grid is never finer than at this |logit|."
)
@click.option(
    "--dtype",
    type=click.Choice(tuple(DEFAULTS)),
    help="Judge both traces on this grid (default: each trace's run metadata, else assumed bf16 and said).",
)
@click.option(
    "--teacher-forced",
    "teacher",
    type=click.Path(dir_okay=False),
    help="Teacher-forced diagnostic trace to cross-check each flip against.",
)
@click.option(
    "--only",
    multiple=True,
    type=click.Choice(CLASS_NAMES),
    help="List only pairs of this class (repeatable; also in --json); the summary still counts all.",
)
@click.option(
    "--tokenizer",
    type=click.Path(),
    help="Model/tokenizer directory: decodes tokens and gives EOS ids (default: the run metadata's).",
)
@click.option("--a-select", help="Rows of A to compare, e.g. history=full,dtype=fp32 (teacher-forced files).")
@click.option("--b-select", help="Rows of B (and C ...) to compare.")
@click.option("--eos", multiple=True, type=int, help="EOS token id (repeatable), added to the run metadata's.")
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False),
    help="This engine's measured noise (`tracekit calibrate`): the run's flips are tested against it.",
)
@click.option(
    "--reference",
    type=click.Path(dir_okay=False),
    help="A higher-precision replay of A's tokens (FP32 teacher-forced, or the engine's FP32 trace): "
    "each side's error against it at every position.",
)
@click.option("--reference-select", help="Rows of the reference (default for teacher-forced: history=full,dtype=fp32).")
def cmd(
    files,
    as_json,
    markdown,
    grid_floor,
    dtype,
    teacher,
    only,
    tokenizer,
    a_select,
    b_select,
    eos,
    calibration,
    reference,
    reference_select,
    **tol,
) -> int:
    """Pair requests by key (FILES[0] is the reference A; every other file is
    compared with it) and classify each pair: identical, post_eos, bf16_tie_flip,
    cache_boundary, unexplained or incomparable. Exit 0 when no pair is
    unexplained or incomparable, 1 otherwise, 3 when a comparison could not be
    made (the others are still printed)."""
    if len(files) == 1 and teacher and not (a_select and b_select):
        raise click.UsageError(
            "--teacher-forced cross-checks a pair (A.h5 B.h5 --teacher-forced diag.h5); to compare one trace with "
            f"the replay itself, give the replay as B and pick its rows: tracekit diff {files[0]} {teacher} "
            "--b-select history=full,dtype=fp32"
        )
    if len(files) < 2 and not (a_select and b_select):
        raise click.UsageError("give at least two traces: A (the reference) and B")
    if as_json and markdown:
        raise click.UsageError("--json and --markdown are exclusive")
    from tracekit.analyze import diff
    from tracekit.analyze import diff_report as report
    from tracekit.analyze.classify import Thresholds
    from tracekit.calibration import read_calibration
    from tracekit.errors import TracekitError

    thr = Thresholds(grid_floor=grid_floor, **tol)
    cal = read_calibration(calibration) if calibration else None
    results, errors = [], []
    for b in files[1:] or files[:1]:
        try:
            results.append(
                diff(
                    files[0],
                    b,
                    thresholds=thr,
                    a_select=a_select,
                    b_select=b_select,
                    eos=eos,
                    tokenizer=tokenizer,
                    dtype=dtype,
                    teacher=teacher,
                    calibration=cal,
                    reference=reference,
                    reference_select=reference_select,
                )
            )
        except TracekitError as e:
            if len(files) <= 2:
                raise
            results.append(report.Failed(files[0], b, str(e)))
            errors.append(e)
    if errors and len(errors) == len(results):
        raise errors[0]
    if as_json:
        click.echo(json.dumps(report.json_doc(results, only), indent=1))
    else:
        decode = _decoder(files[0], tokenizer)
        fmt = report.markdown if markdown else report.text
        click.echo("\n\n".join(fmt(r, only, decode) for r in results))
    for r in results:
        if isinstance(r, report.Failed):
            click.echo(f"Error: {r.a} vs {r.b}: {r.error}", err=True)
    if errors:
        return 3
    return 0 if all(r.ok for r in results) else 1


def _decoder(path: str, tokenizer: str | None):
    from tracekit.analyze.tokens import load_decoder
    from tracekit.store import TraceReader

    with TraceReader(path) as r:
        return load_decoder(tokenizer, r.meta.record)
