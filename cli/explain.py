"""`tracekit explain A.h5 B.h5 --url URL` (or `RUN_DIR --url URL`): the cause of each flip.

The one place that wires the three steps: `tracekit.analyze.explain.select_pairs`
(which pairs diverge, from `tracekit.analyze.diff`), `tracekit.capture.explain` (rerun them
under controlled variants on the live engine(s), replay them teacher-forced),
`tracekit.analyze.explain.explain` (score the runs, name the cause). `explain_files`
is the library entry for one A/B pair of traces (e.g. for `tracekit demo`)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click

EPILOG = """\b
Examples:
  tracekit explain serial.h5 burst.h5 --url http://127.0.0.1:8000
  tracekit explain serial.h5 burst.h5 --url URL --keys p00,p08 --repeats 5 \\
      --teacher-forced fixtures/models/tiny --fp32-url URL2 --deterministic-url URL3 --markdown
  tracekit explain traces/demo --url URL          # every divergent cell of a run directory
"""


@dataclass(frozen=True)
class ExplainOptions:
    url: str
    repeats: int = 5
    model_dir: str | None = None  # teacher-forced replay
    dtypes: str = "fp32,bf16"
    device: str = "cpu"
    deterministic_url: str | None = None
    fp32_url: str | None = None
    top_logprobs: int = 5
    drift_nats: float = 0.5
    timeout_s: float = 600.0
    api_key_env: str | None = None
    config_repeats: int | None = None  # runs of each variant on the deterministic / FP32 configurations


def _log(msg: str) -> None:
    """Progress on stderr, only on a terminal (stdout carries the verdicts)."""
    if sys.stderr.isatty():
        click.echo(msg, err=True)


def explain_files(a: str, b: str, root: Path, o: ExplainOptions, keys: list[str] | None = None):
    """Explain the divergent (or chosen) pairs of A and B; traces and explain.json under root.
    Returns the ExplainResult."""
    from tracekit.analyze.explain import explain, select_pairs

    pairs, skipped, _ = select_pairs(a, b, keys)
    notes, variants, teacher, mates = [], [], None, {}
    if pairs:
        variants, teacher, mates, notes = _run(a, b, pairs, root, o)
    result = explain(a, b, pairs, [str(v) for v in variants], teacher, mates, skipped, o.drift_nats, notes)
    if pairs:
        doc = result.to_json()
        doc["traces"] = {"variants": [v.name for v in variants], "teacher_forced": teacher and Path(teacher).name}
        (root / "explain.json").write_text(json.dumps(doc, indent=1) + "\n")
    return result


def _run(a, b, pairs, root: Path, o: ExplainOptions):
    """Plan the targets, run the variants on each given URL and the teacher-forced replay."""
    from tracekit.capture.explain import ReplayConfig, VariantConfig, plan_targets, replay, run_variants

    targets = plan_targets(a, b, pairs)
    root.mkdir(parents=True, exist_ok=True)
    notes, variants, teacher = [], [], None
    for config, url in (("engine", o.url), ("deterministic", o.deterministic_url), ("fp32", o.fp32_url)):
        if not url:
            notes.append(f"{config} configuration: not run (no --{config}-url)")
            continue
        path = root / f"variants-{config}.h5"
        reps = o.repeats if config == "engine" or o.config_repeats is None else o.config_repeats
        vcfg = VariantConfig(url, str(path), config, reps, o.top_logprobs, o.timeout_s)
        _log(f"explain: {len(targets)} pairs x {reps} repeats on {url} ({config}) -> {path}")
        s = run_variants(dataclasses.replace(vcfg, api_key_env=o.api_key_env), targets)
        notes += s.notes
        variants.append(path)
    if o.model_dir:
        teacher = str(root / "teacher.h5")
        _log(f"explain: teacher-forced replay of {len(targets)} pairs -> {teacher}")
        dts = tuple(d.strip() for d in o.dtypes.split(",") if d.strip())
        replay(ReplayConfig(o.model_dir, teacher, dts, o.device, o.top_logprobs), targets)
    else:
        notes.append("teacher-forced replay: not run (no --teacher-forced MODEL_DIR)")
    return variants, teacher, {t.key: len(t.mates) for t in targets}, notes


def explain_run_cells(root: Path, m, o: ExplainOptions, only: list[str] | None = None, teacher: bool = True):
    """Explain every divergent cell of a `tracekit run` directory on engines started here from the
    matrix `m`: per engine configuration, a fresh engine of the cell's own configuration and the
    target's named variants (deterministic, FP32; capture/explain/engines.py), and with `teacher`
    the teacher-forced replay on the target's model (`o.model_dir`, else the target's). Traces and explain.json under
    DIR/cells/<id>/explain/; engine logs under DIR/engines/explain/.
    Returns ([(cell id, ExplainResult)], the engines' records)."""
    from tracekit.capture.explain.engines import start_configs
    from tracekit.capture.matrix.run import model_dir

    from ..rundir import RunDir

    rd = RunDir(root)
    jobs = [(rd.read_cell(cid).cell, a, b) for cid, a, b in _run_dir_cells(root, only)]
    results, records = [], []
    for engine_id in dict.fromkeys(c.engine_id for c, _, _ in jobs):
        group = [j for j in jobs if j[0].engine_id == engine_id]
        _log(f"explain: starting the engines of {engine_id}")
        eng = start_configs(m, group[0][0], rd.root / "engines" / "explain")
        for note in eng.notes:
            click.echo(f"explain: {note}", err=True)
        try:
            for cell, a, b in group:
                _log(f"explain: cell {cell.id}")
                co = dataclasses.replace(
                    o,
                    url=eng.urls["engine"],
                    deterministic_url=eng.urls.get("deterministic"),
                    fp32_url=eng.urls.get("fp32"),
                    model_dir=(o.model_dir or model_dir(m, cell.target)) if teacher else None,
                )
                results.append((cell.id, explain_files(a, b, rd.root / "cells" / cell.id / "explain", co)))
        finally:
            records += eng.stop()
    return results, records


def _run_dir_cells(root: Path, only: list[str] | None) -> list[tuple[str, str, str]]:
    """(cell id, A, B) of each cell of a run directory whose diff has divergent pairs."""
    from ..rundir import RunDir

    rd = RunDir(root)
    out = []
    for c in rd.load()[1]:
        rec = c.record
        if only and rec.cell.id not in only:
            continue
        if c.diff is None or rec.baseline is None or rec.burst is None:
            continue
        if any(p.position is not None and p.cls not in ("identical", "incomparable") for p in c.diff.pairs):
            out.append((rec.cell.id, str(rd.path(rec.baseline)), str(rd.path(rec.burst))))
    return out


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
@click.option("--drift-nats", type=float, default=0.5, show_default=True, help="A run is numeric within this.")
@click.option("--timeout-s", type=float, default=600.0, show_default=True, help="Per request.")
@click.option("--api-key-env", metavar="VAR", help="Read the API key from env VAR (never stored).")
@click.option("--out", type=click.Path(file_okay=False), help="Directory for the traces (default explain-<UTC>).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema tracekit.explain/1).")
@click.option("--markdown", is_flag=True, help="Print markdown to paste into a pull request.")
def cmd(a, b, url, keys, cells, repeats, config_repeats, model_dir, dtypes, device, deterministic_url, fp32_url,
        top_logprobs, drift_nats, timeout_s, api_key_env, out, as_json, markdown) -> int:  # fmt: skip
    """For each divergent pair of A (reference) and B, rerun the request under
    controlled variants on the live engine (alone cold, alone warm at each side's
    reused-prefix boundary, in a burst with B's batch mates; on the deterministic
    and FP32 configurations when given) and teacher-forced, record every run as
    trace rows under --out, and name the factor that reproduces B's token.
    With a `tracekit run` directory instead of A and B, every cell with divergent
    pairs (serial baseline = A, burst = B), traces under DIR/cells/<id>/explain/.
    Exit 0 when every pair has a numeric cause, 1 when some pair is not
    reproduced (report it as a bug) or unresolved."""
    from tracekit.analyze.explain_report import markdown as md
    from tracekit.analyze.explain_report import text

    if as_json and markdown:
        raise click.UsageError("--json and --markdown are exclusive")
    o = ExplainOptions(url, repeats, model_dir, dtypes, device, deterministic_url, fp32_url, top_logprobs,
                       drift_nats, timeout_s, api_key_env, config_repeats)  # fmt: skip
    chosen = [k.strip() for k in keys.split(",") if k.strip()] if keys else None
    if Path(a).is_dir():
        if b is not None:
            raise click.UsageError("give A.h5 B.h5, or one run directory")
        only = [c.strip() for c in cells.split(",") if c.strip()] if cells else None
        base = Path(out) if out else None
        jobs = [(cid, ca, cb, (base / cid) if base else Path(a) / "cells" / cid / "explain")
                for cid, ca, cb in _run_dir_cells(Path(a), only)]  # fmt: skip
    else:
        if b is None:
            raise click.UsageError("give two traces, A (the reference) and B, or a run directory")
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        jobs = [(None, a, b, Path(out or f"explain-{stamp}"))]
    results = []
    for cid, ja, jb, root in jobs:
        if cid is not None:
            _log(f"explain: cell {cid}")
        results.append((cid, root, explain_files(ja, jb, root, o, chosen)))
    if as_json:
        docs = [r.to_json() | ({"cell": cid} if cid else {}) for cid, _, r in results]
        doc = docs[0] if len(jobs) == 1 and jobs[0][0] is None else {"schema": "tracekit.explain-run/1", "cells": docs}
        click.echo(json.dumps(doc, indent=1))
    else:
        for cid, root, r in results:
            head = f"## cell {cid}\n\n" if cid else ""
            click.echo(head + (md(r) if markdown else text(r)))
            if r.pairs:
                click.echo(f"\ntraces: {root}/ (variants-*.h5, teacher.h5, explain.json)\n")
        if not jobs:
            click.echo("no cell with divergent pairs: nothing to explain")
    return 0 if all(r.ok for _, _, r in results) else 1
