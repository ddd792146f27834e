"""Issue 26's Must-show: the CPU matrix (fixtures/matrix/cpu_small.toml) run as 3 shards in
parallel processes (`tracekit run --shard I/3`) and merged (`tracekit report S0 S1 S2 --out M`)
gives the same cells, verdicts, counts and report tables as the unsharded run, timing columns
aside. Mixing shards of two matrices is refused with one line; a missing shard is reported by
name with its cells; a killed shard reruns alone with --resume, the others untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.analyze.run_report import load_rows, pair_rows, table_rows
from tracekit.rundir import RunDir
from tracekit.workflows.explain import run_dir_cells

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "fixtures/matrix/cpu_small.toml"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
pytestmark = pytest.mark.slow
TIMING = ("tok/s", "TTFT p50/p90/p99 ms")  # the report's timing columns


def argv(*args) -> list[str]:
    return [sys.executable, "-m", "tracekit", *map(str, args)]


def tk(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(argv(*args), capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("shards")
    whole = tk("run", MATRIX, "--out", base / "whole")
    assert whole.returncode == 1, whole.stderr  # the fault cell fails the run
    procs = [
        subprocess.Popen(
            argv("run", MATRIX, "--out", base / f"s{i}", "--shard", f"{i}/3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        for i in range(3)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode in (0, 1), err
    merged = tk("report", *(base / f"s{i}" for i in range(3)), "--out", base / "merged", "--json")
    return base, whole, outs, merged


PAIR_FACTS = ("key", "class", "position", "token_a", "token_b", "boundary_a", "boundary_b")
CELL_FACTS = ("id", "target", "dtype", "prefix_cache", "prompts", "output_tokens", "concurrency", "verdict")
CELL_FACTS += ("checks", "failed_checks", "diff_error", "paths", "pitfalls")


def _facts(c: dict) -> dict:
    """What a cell's evidence says that does not depend on timing: its axes, verdict and checks,
    and for FP32 cells (N/N whatever the batching) its classes and every pair's key, class,
    position, tokens and boundaries. A BF16 burst's tie flips depend on which requests shared a
    batched step, which the scheduler's timing decides: two unsharded runs differ there too."""
    out = {k: c[k] for k in CELL_FACTS}
    out["failing"] = {k: c["classes"][k] for k in ("unexplained", "incomparable")}
    if c["dtype"] == "fp32":
        out["equality"], out["classes"] = c["equality"], c["classes"]
        out["pairs"] = [{k: p[k] for k in PAIR_FACTS} for p in c["divergent"]]
    else:  # BF16: whatever diverged is benign on both sides
        out["benign"] = all(p["class"] in ("bf16_tie_flip", "post_eos", "cache_boundary") for p in c["divergent"])
    return out


def _untimed(head, body):
    keep = [i for i, h in enumerate(head) if h not in TIMING]
    return [head[i] for i in keep], [[row[i] for i in keep] for row in body]


def test_three_shards_merged_equal_the_unsharded_run(runs):
    base, whole, outs, merged = runs
    assert merged.returncode == 1, merged.stderr  # same verdict: the fault cell fails
    doc = json.loads(merged.stdout)
    ref = json.loads(tk("report", base / "whole", "--json").stdout)
    assert [c["id"] for c in doc["cells"]] == [c["id"] for c in ref["cells"]] and len(doc["cells"]) == 9
    assert [_facts(c) for c in doc["cells"]] == [_facts(c) for c in ref["cells"]]
    assert doc["failed_cells"] == ref["failed_cells"] == ["ref-fault.fp32.cache-on.cpu_small.out32.c8"]
    for k in ("cells", "passed", "failed", "pairs", "unexplained", "incomparable"):
        assert doc["totals"][k] == ref["totals"][k], k
    assert doc["shards"] == {
        "count": 3,
        "given": [0, 1, 2],
        "incomplete": [],
        "missing_shards": [],
        "missing_cells": [],
    }
    md = (base / "merged/report/report.md").read_text()
    assert "8/9 cells pass" in md and "Merged from 3 of 3 shards" in md
    for name in ("classes", "gaps", "drift"):
        assert (base / "merged/report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each shard ran only its own cells, and says so
    counts = [len(json.loads((base / f"s{i}/shard.json").read_text())["cells"]) for i in range(3)]
    assert counts == [2, 5, 2]
    for i, (stdout, _) in enumerate(outs):
        assert f"cells pass (shard {i}/3)" in stdout


def test_the_merge_changes_no_number_of_any_shard(runs):
    """The merged report is exactly its shards' evidence: every cell's JSON (timing included),
    the cell table and the pair table, row for row, equal to the shards' own, in matrix order."""
    base = runs[0]
    doc = json.loads((base / "merged/report/summary.json").read_text())
    shard_cells = {}
    shard_rows = []
    for i in range(3):
        shard_cells.update({c["id"]: c for c in json.loads((base / f"s{i}/report/summary.json").read_text())["cells"]})
        shard_rows += load_rows(base / f"s{i}")[1]
    assert doc["cells"] == [shard_cells[c["id"]] for c in doc["cells"]]
    order = {c["id"]: n for n, c in enumerate(doc["cells"])}
    shard_rows.sort(key=lambda r: order[r.cell.id])
    merged_rows = load_rows(base / "merged")[1]
    assert table_rows(merged_rows) == table_rows(shard_rows) and pair_rows(merged_rows) == pair_rows(shard_rows)
    totals = [json.loads((base / f"s{i}/report/summary.json").read_text())["totals"] for i in range(3)]
    assert doc["totals"] == {k: sum(t[k] for t in totals) for k in doc["totals"]}
    # and the table as rendered, timing columns aside, has the unsharded run's shape and cells
    whole_rows = load_rows(base / "whole")[1]
    head_m, body_m = _untimed(*table_rows(merged_rows))
    head_w, body_w = _untimed(*table_rows(whole_rows))
    assert head_m == head_w and [r[:4] + r[-1:] for r in body_m] == [r[:4] + r[-1:] for r in body_w]


def test_the_merged_directory_is_a_run_directory(runs):
    """Its manifest hashes every file (hard links of the shards' files), and explain reads it."""
    base = runs[0]
    m = base / "merged"
    man = json.loads((m / "manifest.json").read_text())
    assert man["merged"]["count"] == 3 and man["shard"] is None
    assert man["matrix"]["sha256"] == hashlib.sha256(MATRIX.read_bytes()).hexdigest()
    files = {p.relative_to(m).as_posix() for p in m.rglob("*") if p.is_file()}
    assert set(man["files"]) == {f for f in files if f != "manifest.json" and not f.startswith("report/")}
    for rel, sha in man["files"].items():
        assert hashlib.sha256((m / rel).read_bytes()).hexdigest() == sha, rel
    assert len(man["engines"]) == 5  # one engine configuration per group here: no shard shared one
    whole = [(c, Path(a).relative_to(base / "whole"), Path(b).relative_to(base / "whole"))
             for c, a, b in run_dir_cells(base / "whole", None)]  # fmt: skip
    assert (
        whole and [(c, Path(a).relative_to(m), Path(b).relative_to(m)) for c, a, b in run_dir_cells(m, None)] == whole
    )


def test_mixing_two_matrices_is_refused_with_one_line(runs, tmp_path):
    """A real shard of another matrix (one cell of the same engine, 8 output tokens)."""
    base = runs[0]
    other = tmp_path / "other.toml"
    other.write_text(
        'name = "cpu-other"\n[run]\ntimeout_s = 120\nready_timeout_s = 120\n'
        f'[[prompts]]\nname = "cpu_small"\npath = "{ROOT}/fixtures/prompts/cpu_small.jsonl"\n'
        "[axes]\nconcurrency = [4]\noutput_tokens = [8]\n"
        '[[target]]\nname = "ref"\nserve = ["--threads", "1", "--slots", "8"]\n'
    )
    o = tk("run", other, "--out", tmp_path / "o", "--shard", "1/3")  # its one cell is in shard 1
    assert o.returncode in (0, 1), o.stderr
    p = tk("report", base / "s0", tmp_path / "o", "--out", tmp_path / "mixed")
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
    assert "'cpu-other'" in lines[0] and "'cpu-small'" in lines[0] and "different matrices" in lines[0]
    assert not (tmp_path / "mixed").exists()


def test_a_missing_shard_is_reported_by_name(runs, tmp_path):
    base = runs[0]
    gone = json.loads((base / "s2/shard.json").read_text())["cells"]
    p = tk("report", base / "s0", base / "s1", "--out", tmp_path / "m", "--json")
    assert p.returncode == 1, p.stderr
    assert "shards missing: 2/3" in p.stderr
    doc = json.loads(p.stdout)
    assert doc["shards"]["missing_shards"] == [2] and doc["shards"]["missing_cells"] == gone
    assert doc["totals"]["cells"] == 9 and set(gone) <= set(doc["failed_cells"])
    md = (tmp_path / "m/report/report.md").read_text()
    assert "**shard 2/3: missing**" in md and all(c in md for c in gone)
    assert len(gone) == 2 and "**6/9 cells pass**" in md  # the fault cell is in shard 1, which was given


def test_a_killed_shard_is_reported_then_reruns_alone_with_resume(runs, tmp_path):
    """What a kill leaves (no manifest; one group's cells gone): the merge reports that shard
    incomplete and names its missing cells, the other shards' evidence intact; `--resume` reruns
    that group only (the kept files byte-identical) and the merge is then whole again."""
    base = runs[0]
    big = max(range(3), key=lambda i: len(json.loads((base / f"s{i}/shard.json").read_text())["cells"]))
    killed = tmp_path / f"s{big}"
    shutil.copytree(base / f"s{big}", killed)
    (killed / "manifest.json").unlink()
    shutil.rmtree(killed / "report")
    cells = json.loads((killed / "shard.json").read_text())["cells"]
    lost = [c for c in cells if c.startswith("ref.bf16.cache-off.")]
    assert len(lost) == 2
    for c in lost:
        shutil.rmtree(killed / "cells" / c)
    kept = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (killed / "cells").rglob("*") if p.is_file()}
    shards = [killed if i == big else base / f"s{i}" for i in range(3)]
    p = tk("report", *shards, "--out", tmp_path / "partial", "--json")
    assert p.returncode == 1 and f"shard {big}/3 ({killed}) has no manifest" in p.stderr
    doc = json.loads(p.stdout)
    assert doc["shards"]["incomplete"] == [big] and doc["shards"]["missing_cells"] == lost
    assert len(doc["cells"]) == 7  # every other cell is there, with its evidence
    r = tk("run", MATRIX, "--out", killed, "--shard", f"{big}/3", "--resume")
    assert r.returncode in (0, 1), r.stderr
    assert f"resume: {len(cells) - 2} cells finished and kept, 2 to run" in r.stderr
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in kept} == kept
    assert RunDir(killed).read_manifest().cells == tuple(cells)
    again = tk("report", *shards, "--out", tmp_path / "again", "--json")
    doc = json.loads(again.stdout)
    assert doc["shards"]["incomplete"] == [] and doc["shards"]["missing_cells"] == []
    assert doc["totals"]["cells"] == 9 and len(doc["cells"]) == 9


def test_stats_reads_the_merged_run_like_the_unsharded_one(runs):
    base = runs[0]
    docs = [json.loads(tk("stats", base / d, "--json").stdout) for d in ("merged", "whole")]
    groups = [{g["group"]: (len(g["paths"]), g["completions"], g["prompts_total"]) for g in d["groups"]} for d in docs]
    assert groups[0] == groups[1] and len(groups[0]) == 5
    for d in docs:  # FP32 groups: serial and bursts give the same tokens in both runs
        assert all(g["prompts_split"] == 0 for g in d["groups"] if g["group"].startswith("ref.fp32."))
