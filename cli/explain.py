"""`tracekit explain A.h5 B.h5 --url URL` (or `RUN_DIR --url URL`): the cause of each flip.

Parses the options and prints; the work is `tracekit.workflows.explain`."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from pathlib import Path

import click

EPILOG = """\b
Examples:
  tracekit explain serial.h5 burst.h5 --url http://127.0.0.1:8000
  tracekit explain serial.h5 burst.h5 --url URL --keys p00,p08 --repeats 5 \\
      --teacher-forced fixtures/models/tiny --fp32-url URL2 --deterministic-url URL3 --markdown
  tracekit explain traces/demo --url URL          # every divergent cell of a run directory
"""


def written(root: Path) -> str:
    """The files explain left in `root`, as they are there (teacher.h5 only with --teacher-forced)."""
    names = sorted(p.name for p in Path(root).glob("variants-*.h5"))
    names += [n for n in ("teacher.h5", "explain.json") if (Path(root) / n).is_file()]
    return ", ".join(names) or "nothing written"


@click.command(epilog=EPILOG)
@click.argument("a", type=click.Path(exists=True))
@click.argument("b", required=False, type=click.Path(dir_okay=False))
@click.option("--url", required=True, help="The engine B ran on (the variants run here).")
@click.option("--keys", help="Explain these keys (comma-separated) instead of every divergent pair.")
@click.option("--cells", help="RUN_DIR form: only these cells (comma-separated ids).")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Runs of each variant.")
@click.option(
    "--config-repeats",
    type=click.IntRange(1),
    help="Runs of each variant on the deterministic and FP32 configurations (default: --repeats).",
)
@click.option("--teacher-forced", "model_dir", type=click.Path(file_okay=False), help="Replay outside the engine.")
@click.option("--dtype", "dtypes", default="fp32,bf16", show_default=True, help="Teacher-forced dtypes.")
@click.option("--device", default="cpu", show_default=True, help="Teacher-forced device.")
@click.option("--deterministic-url", help="The same engine in its deterministic (batch-invariant) configuration.")
@click.option("--fp32-url", help="The same engine in FP32.")
@click.option("--top-logprobs", type=click.IntRange(2, 20), default=5, show_default=True)
@click.option(
    "--drift-nats",
    type=float,
    default=None,
    help="A run is numeric within this (default: measured from --calibration, else 0.5 nats, said).",
)
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False),
    help="This engine's measured noise (`tracekit calibrate`): the numeric bound comes from it.",
)
@click.option(
    "--allow-engine-mismatch",
    is_flag=True,
    help="Explain even when an engine's self-report (model, dtype, slots, prefix cache, family) differs "
    "from the traces' run metadata; the mismatch is noted.",
)
@click.option(
    "--engine-replay",
    is_flag=True,
    help="Also replay each pair's tokens through the engine at --url itself (cold, at A's and at B's boundary, "
    "proven by its report; capture --replay-http): its own logits decide a cache-history cause.",
)
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False),
    help="With --calibration: an FP32 replay of A's tokens (as `diff --reference`) for the run-level test "
    "(default: made with --teacher-forced MODEL_DIR).",
)
@click.option("--timeout-s", type=float, default=600.0, show_default=True, help="Per request.")
@click.option("--api-key-env", metavar="VAR", help="Read the API key from env VAR (never stored).")
@click.option("--out", type=click.Path(file_okay=False), help="Directory for the traces (default explain-<UTC>).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema tracekit.explain/1).")
@click.option("--markdown", is_flag=True, help="Print markdown to paste into a pull request.")
def cmd(a, b, url, keys, cells, repeats, config_repeats, model_dir, dtypes, device, deterministic_url, fp32_url,
        top_logprobs, drift_nats, calibration, allow_engine_mismatch, engine_replay, reference, timeout_s,
        api_key_env, out, as_json, markdown) -> int:  # fmt: skip
    """For each divergent pair of A (reference) and B, rerun the request under
    controlled variants on the live engine (alone cold, alone warm at each side's
    reused-prefix boundary, in a burst with B's batch mates; on the deterministic
    and FP32 configurations when given) and teacher-forced, record every run as
    trace rows under --out, and name the factor that reproduces B's token.
    With a `tracekit run` directory instead of A and B, every cell with divergent
    pairs (serial baseline = A, burst = B), traces under DIR/cells/<id>/explain/.
    With --calibration (a run directory: the calibration the run judged each
    cell with), "numeric" means within this engine's measured noise, and a
    benign pair no run tipped at a gap the healthy repeats flip at is
    `calibrated_noise`, not a bug; and A vs B is judged as `diff --calibration
    --reference` judges it (an FP32 replay of A from --reference or
    --teacher-forced): when the run fails a run-level test, every pair a rule
    calls benign is a `bug` (a batched-path error across the run). Exit 0 when every pair has a cause (a
    numeric variant, or the calibrated noise), 1 when some pair's line says
    `bug` ("report as a bug", LOUD when its class was benign) or `unresolved`;
    `tracekit demo` exits 1 on the same lines. Each URL's self-report is checked
    against A's and B's run metadata first (model, dtype, slots, prefix cache,
    family): a mismatch stops with one line unless --allow-engine-mismatch; the
    URL and the report go into explain.json."""
    from tracekit.analyze.explain_report import markdown as md
    from tracekit.analyze.explain_report import text
    from tracekit.rundir import RunDir
    from tracekit.workflows.explain import ExplainOptions, explain_files, log, run_dir_cells
    from tracekit.workflows.judge import cell_calibration

    if as_json and markdown:
        raise click.UsageError("--json and --markdown are exclusive")
    o = ExplainOptions(url, repeats, model_dir, dtypes, device, deterministic_url, fp32_url, top_logprobs,
                       drift_nats, timeout_s, api_key_env, config_repeats, calibration,
                       allow_engine_mismatch, engine_replay, reference)  # fmt: skip
    chosen = [k.strip() for k in keys.split(",") if k.strip()] if keys else None
    if Path(a).is_dir():
        if b is not None:
            raise click.UsageError("give A.h5 B.h5, or one run directory")
        only = [c.strip() for c in cells.split(",") if c.strip()] if cells else None
        base = Path(out) if out else None
        jobs = [(cid, ca, cb, (base / cid) if base else Path(a) / "cells" / cid / "explain")
                for cid, ca, cb in run_dir_cells(Path(a), only)]  # fmt: skip
    else:
        if b is None:
            raise click.UsageError("give two traces, A (the reference) and B, or a run directory")
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        jobs = [(None, a, b, Path(out or f"explain-{stamp}"))]
    results = []
    for cid, ja, jb, root in jobs:
        co = o
        if cid is not None:
            log(f"explain: cell {cid}")
            # the calibration the run judged the cell with (`tracekit run`/`demo`), unless --calibration
            co = dataclasses.replace(o, calibration=o.calibration or cell_calibration(RunDir(a), cid))
        results.append((cid, root, explain_files(ja, jb, root, co, chosen)))
    if as_json:
        docs = [r.to_json() | ({"cell": cid} if cid else {}) for cid, _, r in results]
        doc = docs[0] if len(jobs) == 1 and jobs[0][0] is None else {"schema": "tracekit.explain-run/1", "cells": docs}
        click.echo(json.dumps(doc, indent=1))
    else:
        for cid, root, r in results:
            head = f"## cell {cid}\n\n" if cid else ""
            click.echo(head + (md(r) if markdown else text(r)))
            if r.pairs:
                click.echo(f"\ntraces: {root}/ ({written(root)})\n")
        if not jobs:
            click.echo("no cell with divergent pairs: nothing to explain")
    return 0 if all(r.ok for _, _, r in results) else 1
