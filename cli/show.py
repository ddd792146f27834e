"""`tracekit show A [B] --key K`: the tokens around a divergence, side by side."""

from __future__ import annotations

import json

import click

EPILOG = """\b
Examples:
  tracekit show serial.h5 concurrent.h5 --key p017
  tracekit show serial.h5 concurrent.h5 --first-divergent      # the first key whose tokens differ
  tracekit show serial.h5 concurrent.h5 --key p017 --position 12 --context 3 --json
"""


@click.command(epilog=EPILOG)
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", required=False, type=click.Path(dir_okay=False))
@click.option("--key", help="Request key to show.")
@click.option("--first-divergent", is_flag=True, help="Show the first key (in A's order) whose token ids differ in B.")
@click.option("--position", type=click.IntRange(min=0), help="Position to centre on (default: first difference).")
@click.option(
    "--context", type=click.IntRange(min=0), default=5, show_default=True, help="Positions shown on each side."
)
@click.option(
    "--topk", type=click.IntRange(min=1), default=5, show_default=True, help="Candidates listed at the position."
)
@click.option("--tokenizer", type=click.Path(), help="Tokenizer directory (default: the run metadata's).")
@click.option("--a-select", help="Row of A for a teacher-forced file, e.g. history=full,dtype=fp32.")
@click.option("--b-select", help="Row of B for a teacher-forced file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def cmd(a, b, key, first_divergent, position, context, topk, tokenizer, a_select, b_select, as_json) -> None:
    """Show request KEY of trace A (and B) around POSITION: ids, decoded text,
    logprobs, and at the position the top-k with raw logits and ULP distances."""
    if bool(key) == first_divergent:
        raise click.UsageError("give --key K or --first-divergent (one of them)")
    if first_divergent and b is None:
        raise click.UsageError("--first-divergent compares two traces: give A and B")
    from tracekit.analyze.show import drill, first_divergent_key, render
    from tracekit.analyze.tokens import load_decoder
    from tracekit.store import TraceReader

    if first_divergent:
        key = first_divergent_key(a, b, a_select, b_select)

    with TraceReader(a) as r:
        decode = load_decoder(tokenizer, r.meta.record)
    d = drill(a, b, key, position, context, topk, decode, a_select, b_select)
    click.echo(json.dumps(d, indent=1) if as_json else render(d))
