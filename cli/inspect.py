"""`tracekit inspect FILE`: validate a trace and summarise what it holds."""

from __future__ import annotations

import json

import click
import numpy as np

from ..store import TraceReader


def summarize(path: str, verify: bool = True) -> dict:
    """Everything `inspect` reports, as JSON-able data. The trace's structure is checked
    when it opens; `verify` also reads every token and prompt row (damaged chunks)."""
    with TraceReader(path) as r:
        verified = r.verify() if verify else None
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
            "verified_bytes": verified,
            "checksum": r.meta.checksum or None,
        }
        if r.meta.source == "teacher_forced":
            out["histories"] = sorted(set(t.history.tolist()))
            out["dtypes"] = sorted(set(t.dtype.tolist()))
    return out


@click.command(epilog="\b\nExample:\n  tracekit inspect fixtures/format/v1/reference.h5 --json")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--quick", is_flag=True, help="Check the structure only; skip reading every token row.")
def cmd(file: str, as_json: bool, quick: bool) -> None:
    """Validate a trace FILE and show its metadata, counts and columns.

    Exit 0 when the trace is whole; 3 with one `Error:` line naming the damaged
    dataset otherwise. A capture killed mid-run is rebuilt from its journal first."""
    s = summarize(file, verify=not quick)
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
    vb = s["verified_bytes"]
    click.echo(f"checked: {'structure only (--quick)' if vb is None else f'every row read ({vb:,} bytes)'}")
    click.echo(
        "checksums: Fletcher-32 on every dataset (each chunk checked as it is read)"
        if s["checksum"]
        else "checksums: none (written before tracekit checksummed its traces: damaged data cannot be detected)"
    )
    if "histories" in s:
        click.echo(f"histories: {', '.join(s['histories'])}  dtypes: {', '.join(s['dtypes'])}")
    run = s["run"]
    for k in ("model", "target", "dialect", "engine_family", "dtype", "prompt_ids", "concurrency", "command"):
        if k in run:
            click.echo(f"{k}: {run[k] if not isinstance(run[k], (dict, list)) else json.dumps(run[k])}")
