"""`tracekit diff A B [C ...]`: classify every request's divergence from A."""

from __future__ import annotations

import json

import click

from analyze.classify import CLASSES as CLASS_NAMES  # light: numpy and the store, no torch

EPILOG = """\b
Examples:
  tracekit diff serial.h5 concurrent.h5
  tracekit diff serial.h5 concurrent.h5 --markdown --only unexplained
  tracekit diff http.h5 diag.h5 --b-select history=full,dtype=fp32 --json
  tracekit diff serial.h5 prefix_on.h5 --teacher-forced diag.h5
"""


@click.command(epilog=EPILOG)
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema tracekit.diff/1).")
@click.option("--markdown", is_flag=True, help="Print a markdown block to paste into a pull request.")
@click.option(
    "--tie-ulps",
    type=float,
    default=4.0,
    show_default=True,
    help="Tie tolerance in BF16 ULPs at the logits' magnitude (traces with raw logits).",
)
@click.option(
    "--tie-nats",
    type=float,
    default=0.125,
    show_default=True,
    help="Tie tolerance in nats (traces with logprobs only).",
)
@click.option(
    "--drift-nats",
    type=float,
    default=0.5,
    show_default=True,
    help="Drift tolerance: pre-divergence |Δlogprob| and cache_boundary gaps.",
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
    help="List only pairs of this class (repeatable); the summary still counts all.",
)
@click.option("--tokenizer", type=click.Path(), help="Tokenizer directory to decode tokens (default: run metadata).")
@click.option("--a-select", help="Rows of A to compare, e.g. history=full,dtype=fp32 (teacher-forced files).")
@click.option("--b-select", help="Rows of B (and C ...) to compare.")
@click.option("--eos", multiple=True, type=int, help="EOS token id (repeatable), added to the run metadata's.")
def cmd(
    files, as_json, markdown, tie_ulps, tie_nats, drift_nats, teacher, only, tokenizer, a_select, b_select, eos
) -> int:
    """Pair requests by key (FILES[0] is the reference A; every other file is
    compared with it) and classify each pair: identical, post_eos, bf16_tie_flip,
    cache_boundary, unexplained or incomparable. Exit 0 when no pair is
    unexplained or incomparable, 1 otherwise."""
    if len(files) < 2 and not (a_select and b_select):
        raise click.UsageError("give at least two traces: A (the reference) and B")
    if as_json and markdown:
        raise click.UsageError("--json and --markdown are exclusive")
    from analyze import diff, report

    others = files[1:] or files[:1]
    results = [
        diff(
            files[0],
            b,
            tie_ulps=tie_ulps,
            tie_nats=tie_nats,
            drift_nats=drift_nats,
            a_select=a_select,
            b_select=b_select,
            eos=eos,
            teacher=teacher,
        )
        for b in others
    ]
    if as_json:
        click.echo(json.dumps(report.json_doc(results), indent=1))
    else:
        decode = _decoder(files[0], tokenizer)
        fmt = report.markdown if markdown else report.text
        click.echo("\n\n".join(fmt(r, only, decode) for r in results))
    return 0 if all(r.ok for r in results) else 1


def _decoder(path: str, tokenizer: str | None):
    from analyze.tokens import load_decoder
    from tracekit.store import TraceReader

    with TraceReader(path) as r:
        return load_decoder(tokenizer, r.meta.run)
