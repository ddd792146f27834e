"""`tracekit demo`: the whole method on the embedded default, one command.

Runs fixtures/matrix/demo.toml (the reference engine with the tiny fixture
model; FP32 and BF16 with prefix reuse; serial baseline vs concurrent bursts),
replays every divergent key through the teacher-forced diagnostic, diffs with
that cross-check, and prints the evidence table and where everything is.

Exit 0 when it ran and the FP32 controls are N/N identical with every check
passing: BF16 divergences are the expected finding, not a failure. Exit 1
(loudly) when an FP32 control diverges, or a cell has unexplained /
incomparable pairs or a failed check.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
import time
from pathlib import Path

import click
from tabulate import tabulate

from ..engine.process import REPO_ROOT

MATRIX = REPO_ROOT / "fixtures" / "matrix" / "demo.toml"
BENIGN = ("bf16_tie_flip", "cache_boundary", "post_eos")
EPILOG = """\b
Examples:
  tracekit demo                      # everything under traces/demo-<timestamp>/
  tracekit demo --out traces/demo
"""


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _divergent(root: Path, cell_id: str) -> list[str]:
    d = json.loads((root / "cells" / cell_id / "diff.json").read_text())
    return [
        p["key"] for p in d["pairs"] if p["class"] not in ("identical", "incomparable") and p["position"] is not None
    ]


def teacher_step(root: Path, m, outcomes) -> dict:
    """Teacher-forced diagnostic of each cell's divergent keys (from its serial baseline),
    then the cell's diff again with that cross-check. Returns the manifest's `teacher` entry."""
    from analyze import diff
    from capture.teacher import run_from_options

    args = m.target("ref").args
    model = args[args.index("--model") + 1] if "--model" in args else str(REPO_ROOT / "fixtures/models/tiny")
    done = {}
    for o in outcomes:
        cdir = root / "cells" / o.cell.id
        if o.baseline is None or o.burst is None or not (cdir / "diff.json").is_file():
            continue
        keys = _divergent(root, o.cell.id)
        if not keys:
            continue
        _log(f"teacher-forced: {o.cell.id}: {len(keys)} divergent keys")
        run_from_options(
            teacher_forced=model,
            out=str(cdir / "teacher.h5"),
            from_path=str(root / o.baseline),
            keys=",".join(keys),
            history="full,prefix:auto,decode",
            dtype="fp32,bf16",
        )
        doc = diff(root / o.baseline, root / o.burst, teacher=cdir / "teacher.h5").to_json()
        doc["a"], doc["b"] = o.baseline, o.burst
        (cdir / "diff.json").write_text(json.dumps(doc, indent=1) + "\n")
        done[o.cell.id] = {
            "keys": keys,
            "trace": f"cells/{o.cell.id}/teacher.h5",
            "histories": "full,prefix:auto,decode",
            "dtypes": "fp32,bf16",
            "model": model,
        }
    return {"teacher_forced": done}


def pair_table(root: Path, rows) -> str:
    body = []
    for r in rows:
        p = root / "cells" / r.cell["id"] / "diff.json"
        if not p.is_file():
            continue
        for q in json.loads(p.read_text())["pairs"]:
            if q["class"] == "identical":
                continue

            def ulp(x):
                return "" if x is None else f"{abs(x):.3g}"

            body.append(
                [
                    f"{r.cell['dtype'].upper()} {r.cell['prompts']} c{r.cell['concurrency']}",
                    q["key"],
                    q["class"],
                    q["position"],
                    f"{q['token_a']} / {q['token_b']}",
                    f"{ulp(q['gap_a_ulp'])} / {ulp(q['gap_b_ulp'])}",
                    f"{q['boundary_a']} / {q['boundary_b']}",
                    q.get("teacher") or "",
                ]
            )
    head = ["cell", "key", "class", "pos", "token A / B", "gap ulp A / B", "reused prefix A / B", "teacher-forced"]
    return tabulate(body, headers=head, tablefmt="github", disable_numparse=True) if body else "(no divergent pair)"


def verdict(rows) -> tuple[bool, list[str]]:
    """(ok, lines): the FP32 controls must be N/N; BF16 divergences are reported as the finding."""
    lines, ok = [], True
    fp32 = [r for r in rows if r.cell["dtype"] == "fp32"]
    same = sum(r.diff["identical"] for r in fp32 if r.diff)
    total = sum(r.diff["pairs"] for r in fp32 if r.diff)
    if not fp32 or any(r.diff is None or r.diff["identical"] != r.diff["pairs"] for r in fp32):
        ok = False
        lines.append(
            f"FAIL: FP32 control is NOT N/N: {same}/{total} identical. FP32 serial vs concurrent must "
            "agree exactly; this engine or machine breaks the demo's premise."
        )
    else:
        lines.append(f"FP32 control: {same}/{total} identical across {len(fp32)} cells (N/N, as required).")
    bf = [r for r in rows if r.cell["dtype"] != "fp32" and r.diff]
    counts = {k: sum(r.diff[k] for r in bf) for k in (*BENIGN, "unexplained", "incomparable")}
    pairs = sum(r.diff["pairs"] for r in bf)
    div = pairs - sum(r.diff["identical"] for r in bf)
    lines.append(
        f"BF16: {div} of {pairs} pairs diverge: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + ". Benign BF16 divergences are the expected finding, not a failure."
    )
    bad = [r.cell["id"] for r in rows if not r.ok]
    if bad:
        ok = False
        lines.append(f"FAIL: {len(bad)} cell(s) with unexplained/incomparable pairs or failed checks: {', '.join(bad)}")
    return ok, lines


@click.command(epilog=EPILOG)
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default traces/demo-<UTC timestamp>).")
def cmd(out) -> int:
    """Start the reference engine with the fixture model, capture serial and
    concurrent runs in FP32 and BF16 with prefix reuse, run the teacher-forced
    diagnostic on the divergent keys, diff, and print the evidence table."""
    from .run import execute

    t0 = time.perf_counter()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(out or f"traces/demo-{stamp}")
    _log(f"tracekit demo: running {MATRIX.relative_to(REPO_ROOT)} into {root}/")
    rows, doc = execute(str(MATRIX), str(root), after_diff=teacher_step)
    from analyze.matrix_report import text_table

    ok, lines = verdict(rows)
    click.echo(
        "tracekit demo: reference engine (tiny fixture model, CPU); serial baseline vs concurrent burst, "
        "FP32 and BF16, prefix cache on\n"
    )
    click.echo(text_table(rows) + "\n")
    click.echo(
        "Divergent pairs (gaps in BF16 ULPs of the raw logits; teacher-forced = does a cache history "
        "or dtype reproduce the flip):\n"
    )
    click.echo(pair_table(root, rows) + "\n")
    click.echo("\n".join(lines))
    click.echo(
        f"\nfiles: {root}/ (manifest.json with sha256 of every file; groups/*/serial.h5, cells/*/burst.h5, "
        "diff.json, checks.json, teacher.h5; engines/*.log)"
    )
    click.echo(f"report: {root / 'report' / 'report.md'}")
    click.echo("plots: " + ", ".join(str(root / p) for p in doc["plots"].values()))
    click.echo(f"took {time.perf_counter() - t0:.0f} s")
    if not ok:
        click.echo("tracekit demo: FAILED (see the FAIL lines above)", err=True)
    sys.stdout.flush()
    return 0 if ok else 1
