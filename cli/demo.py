"""`tracekit demo`: the whole method on the embedded default, one command.

Runs fixtures/matrix/demo.toml (the reference engine with the tiny fixture
model; FP32 and BF16 with prefix reuse; serial baseline vs concurrent bursts;
the same engine with --batch-invariant in BF16) with the teacher-forced replay
of every divergent key, then `tracekit explain` on every cell with divergent
pairs, against fresh engines of the cell's configuration and of the target's
deterministic and FP32 variants (started here on 127.0.0.1, stopped after);
writes the report and prints the evidence (also kept as
DIR/report/demo_stdout.txt).

Exit 0 when it ran, the FP32 controls and the deterministic cells are N/N
identical and every cell passes: BF16 divergences are the expected finding,
not a failure; a LOUD pair (classed benign, reproduced by no variant in the
sampled runs) is printed loudly but does not fail the demo. Exit 1 (loudly)
when a control diverges, a cell fails or the explain step could not run.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from pathlib import Path

import click

from ..runinfo import REPO_ROOT

MATRIX = REPO_ROOT / "fixtures" / "matrix" / "demo.toml"
REPEATS = 3  # runs of each explain variant on the cell's own configuration
CONFIG_REPEATS = 1  # ... on the deterministic and FP32 configurations (they only confirm one token)
EPILOG = """\b
Examples:
  tracekit demo                      # everything under traces/demo-<timestamp>/
  tracekit demo --out traces/demo --repeats 5
"""


def _explain(root: Path, m, repeats: int) -> tuple[list, str | None]:
    """Explain every divergent cell on engines started here; record them in the manifest.
    Returns (the engines' records, the error that stopped it or None)."""
    from tracekit.errors import TracekitError

    from ..rundir import RunDir, now_utc
    from .explain import ExplainOptions, explain_run_cells

    opts = ExplainOptions(url="", repeats=repeats, config_repeats=min(CONFIG_REPEATS, repeats))
    error, records = None, []
    try:
        # No teacher-forced replay here: the run's teacher step already replayed every divergent key.
        _, records = explain_run_cells(root, m, opts, teacher=False)
    except TracekitError as e:
        error = str(e)
    rd = RunDir(root)
    man = rd.read_manifest()
    if man is not None:  # the explain traces and engines join the manifest's hashes and engines
        engines = man.engines + tuple(records)
        rd.write_manifest(dataclasses.replace(man, engines=engines, files=rd.file_hashes(), finished_utc=now_utc()))
    return records, error


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
    --batch-invariant), run the teacher-forced diagnostic on the divergent keys,
    diff, explain each flip on live engines, and print the evidence table and the causes."""
    from tracekit.analyze import explain_cells
    from tracekit.analyze.demo_report import demo_page, demo_verdict, write_demo_page
    from tracekit.analyze.matrix_report import diff_document, write_report
    from tracekit.capture.matrix import TeacherPlan, load_matrix, run

    t0 = time.perf_counter()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(out or f"traces/demo-{stamp}")
    m = load_matrix(MATRIX)
    click.echo(f"tracekit demo: running {MATRIX.relative_to(REPO_ROOT)} into {root}/", err=True)
    run(m, root, diff_document, teacher=TeacherPlan())
    click.echo("tracekit demo: explaining each divergent pair on live engines", err=True)
    _, error = _explain(root, m, repeats)
    report = write_report(root)
    causes = explain_cells.load(root, [r.cell for r in report.rows])
    det = tuple(t.name for t in m.targets if "--batch-invariant" in t.args)
    verdict = demo_verdict(list(report.rows), det, root, causes)
    if error is not None:
        verdict = dataclasses.replace(verdict, ok=False, lines=(*verdict.lines, f"FAIL: explain did not run: {error}"))
    reps = min(CONFIG_REPEATS, repeats)
    sampled = (
        f"every divergent pair of every cell, {repeats} runs of each variant on a fresh engine of the cell's "
        f"configuration, {reps} on its deterministic and FP32 configurations"
    )
    page = demo_page(report, verdict, time.perf_counter() - t0, causes, sampled)
    write_demo_page(report, page)
    click.echo(page)
    if not verdict.ok:
        click.echo("tracekit demo: FAILED (see the FAIL lines above)", err=True)
    return 0 if verdict.ok else 1
