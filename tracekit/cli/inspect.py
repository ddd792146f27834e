"""`tracekit inspect FILE`: validate a trace and summarise what it holds."""

from __future__ import annotations

import json

import click
import numpy as np

from ..store import TraceReader


def summarize(path: str) -> dict:
    """Everything `inspect` reports, as JSON-able data."""
    with TraceReader(path) as r:
        t = r.requests
        lay = r.layout
        out = {
            "file": path,
            "format_version": r.meta.format_version,
            "writer": r.meta.writer,
            "created_utc": r.meta.created_utc,
            "source": r.meta.source,
            "requests": len(t),
            "by_status": t.counts_by_status(),
            "token_rows": r.n_token_rows,
            "prompt_tokens": int(np.maximum(t.prompt_len, 0).sum()),
            "topk": lay.topk,
            "raw_logits": lay.raw_logits,
            "full_logits": lay.vocab_size > 0,
            "vocab_size": lay.vocab_size or None,
            "cached_tokens_reported": int(np.sum(t.cached_tokens >= 0)),
            "run": r.meta.run,
        }
        if r.meta.source == "teacher_forced":
            out["histories"] = sorted(set(t.history.tolist()))
            out["dtypes"] = sorted(set(t.dtype.tolist()))
    return out


@click.command(epilog="Example: tracekit inspect traces/demo/groups/ref.bf16.cache-on.code16.out32/serial.h5 --json")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def cmd(file: str, as_json: bool) -> None:
    """Validate a trace FILE and show its metadata, counts and columns."""
    s = summarize(file)
    if as_json:
        click.echo(json.dumps(s, indent=2, sort_keys=True))
        return
    st = ", ".join(f"{k} {v}" for k, v in s["by_status"].items())
    click.echo(
        f"{s['file']}: tracekit trace v{s['format_version']} ({s['source']}), written by "
        f"{s['writer']} at {s['created_utc']}"
    )
    click.echo(f"requests: {s['requests']} ({st})")
    click.echo(
        f"token rows: {s['token_rows']}  prompt tokens: {s['prompt_tokens']}  top-k: {s['topk']}  "
        f"raw logits: {'yes' if s['raw_logits'] else 'no'}  full logits: "
        f"{'V=' + str(s['vocab_size']) if s['full_logits'] else 'no'}"
    )
    click.echo(f"cached_tokens reported on {s['cached_tokens_reported']}/{s['requests']} requests")
    if "histories" in s:
        click.echo(f"histories: {', '.join(s['histories'])}  dtypes: {', '.join(s['dtypes'])}")
    run = s["run"]
    for k in ("model", "target", "dialect", "dtype", "concurrency", "command"):
        if k in run:
            click.echo(f"{k}: {run[k] if not isinstance(run[k], (dict, list)) else json.dumps(run[k])}")
