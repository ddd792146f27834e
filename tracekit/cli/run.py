"""`tracekit run MATRIX.toml --out DIR`: run every cell of a matrix (capture.matrix),
diff each cell's burst against its serial baseline (analyze.diff), hash DIR
into the manifest, and write the report (analyze.matrix_report).

Exit 0 when every cell passes, 1 when any cell has an unexplained or
incomparable pair or a failed check, 2 usage, 3 tool error (bad matrix).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

EPILOG = """\b
Examples:
  tracekit run fixtures/matrix/cpu_small.toml --out runs/cpu_small
  tracekit report runs/cpu_small --json
"""


def diff_cells(root: Path, outcomes) -> dict[str, str]:
    """analyze.diff per cell -> cells/<id>/diff.json; returns {cell id: error} for cells without a diff."""
    from analyze import diff
    from tracekit.errors import TracekitError

    errors = {}
    for o in outcomes:
        if o.baseline is None or o.burst is None:
            errors[o.cell.id] = "no diff: a capture failed (see its checks)"
            continue
        try:
            r = diff(root / o.baseline, root / o.burst)
        except TracekitError as e:
            errors[o.cell.id] = f"diff failed: {e}"
            continue
        except Exception as e:  # noqa: BLE001 - an analysis crash on one cell must not lose the run:
            # it is recorded as that cell's diff error (the cell then fails) and the run goes on.
            errors[o.cell.id] = f"diff crashed: {type(e).__name__}: {e}"
            continue
        doc = r.to_json()
        doc["a"], doc["b"] = o.baseline, o.burst  # relative to DIR: the directory can move
        (root / "cells" / o.cell.id / "diff.json").write_text(json.dumps(doc, indent=1) + "\n")
    return errors


def execute(matrix_path: str, out: str, after_diff=None):
    """Run + diff + manifest + report; returns (rows, summary). Shared with `tracekit demo`,
    whose after_diff(root, matrix, outcomes) adds the teacher-forced step before the manifest."""
    from analyze.matrix_report import write_report
    from capture.matrix import load_matrix, run_matrix, write_manifest
    from capture.matrix.manifest import now_utc
    from tracekit.errors import ConfigError

    m = load_matrix(matrix_path)
    root = Path(out)
    if (root / "cells").exists() or (root / "manifest.json").exists():
        raise ConfigError(f"{root}: already holds a run; choose another --out (runs are never overwritten)")
    started = now_utc()
    outcomes, engines = run_matrix(m, root)
    diff_errors = diff_cells(root, outcomes)
    extra = after_diff(root, m, outcomes) if after_diff else None
    cells = [
        {
            **o.cell.as_dict(),
            "baseline": o.baseline,
            "burst": o.burst,
            "checks_ok": o.checks_ok,
            "diff_error": diff_errors.get(o.cell.id),
        }
        for o in outcomes
    ]
    write_manifest(
        root,
        matrix={"name": m.name, "path": m.path, "copy": "matrix.toml"},
        engines=engines,
        cells=cells,
        started_utc=started,
        extra=extra,
    )
    rows, doc, _ = write_report(root)
    return rows, doc


@click.command(epilog=EPILOG)
@click.argument("matrix", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory to create.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON summary (tracekit.matrix-report/1).")
def cmd(matrix, out, as_json) -> int:
    """Run a matrix file (docs/runner.md): per cell a serial baseline, a
    concurrent burst, their diff and lifecycle checks; everything under --out
    with a manifest, and the report in OUT/report/."""
    from analyze.matrix_report import text_table

    rows, doc = execute(matrix, out)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        click.echo(text_table(rows))
        click.echo(f"\n{doc['totals']['passed']}/{doc['totals']['cells']} cells pass")
    click.echo(f"report: {Path(out) / 'report' / 'report.md'}", err=True)
    return 0 if not doc["failed_cells"] else 1
