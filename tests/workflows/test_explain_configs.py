"""Matrix targets name their deterministic and FP32 configurations, and `tracekit explain`
of a run directory starts them itself: the cell's flips are rerun on real engines of each
configuration, and `tracekit report` shows every explained pair's cause."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tracekit.analyze.run_report import write_report
from tracekit.capture.explain.engines import configurations
from tracekit.capture.matrix import load_matrix
from tracekit.errors import ConfigError
from tracekit.rundir import RunDir
from tracekit.workflows.explain import ExplainOptions, explain_run_cells
from tracekit.workflows.matrix import run

ROOT = Path(__file__).resolve().parents[2]
MATRIX = """
name = "variants"
[run]
top_logprobs = 5
[[prompts]]
name = "small"
path = "{root}/fixtures/prompts/cpu_small.jsonl"
[axes]
concurrency = [4]
dtype = ["bf16"]
output_tokens = [8]
[[target]]
name = "ref"
model = "{root}/fixtures/models/tiny"
serve = {serve}
[target.variants.deterministic]
args = ["--batch-invariant"]
[target.variants.fp32]
dtype = "fp32"
"""


def _matrix(tmp_path, serve='["--threads", "1", "--slots", "4"]', extra=""):
    p = tmp_path / "m.toml"
    p.write_text(MATRIX.format(root=ROOT, serve=serve) + extra)
    return load_matrix(p)


def test_a_target_names_its_deterministic_and_fp32_configurations(tmp_path):
    m = _matrix(tmp_path)
    cell = m.cells()[0]
    got = {name: (t.name, t.args[-1], c.dtype, c.engine_id) for name, t, c in configurations(m, cell)}
    assert got == {
        "engine": ("ref", "4", "bf16", "ref.bf16.cache-on"),
        "deterministic": ("ref-deterministic", "--batch-invariant", "bf16", "ref-deterministic.bf16.cache-on"),
        "fp32": ("ref-fp32", "4", "fp32", "ref-fp32.fp32.cache-on"),
    }


@pytest.mark.parametrize(
    "extra, says",
    [
        ("[target.variants.slow]\nargs = []\n", "unknown key(s) ['slow']"),
        ("[target.variants.deterministic.more]\n", "unknown key(s) ['more']"),
        ("[target.variants.fp32]\ndtype = 'fp64'\n", "must be one of"),
    ],
)
def test_a_bad_variant_table_is_an_error_that_names_it(tmp_path, extra, says):
    text = MATRIX.format(root=ROOT, serve='["--threads", "1"]').split("[target.variants")[0] + extra
    (tmp_path / "m.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"variants") as e:
        load_matrix(tmp_path / "m.toml")
    assert says in str(e.value)


def test_run_dir_flips_are_explained_on_each_configuration_and_reported(tmp_path):
    """A cell whose engine serves the wrong prefix block (--inject-fault corrupt-prefix-cache)
    diverges; explain starts a fresh engine of the cell's configuration and its deterministic
    and FP32 variants, reruns every divergent pair on each, and the report lists each pair's
    cause with the counts explain found."""
    from tracekit.analyze.explain_report import summary_line

    serve = '["--threads", "1", "--slots", "4", "--inject-fault", "corrupt-prefix-cache"]'
    m = _matrix(tmp_path, serve)
    root = tmp_path / "run"
    run(m, root)
    results, records = explain_run_cells(root, m, ExplainOptions(url="", repeats=1), teacher=False)
    cid = m.cells()[0].id
    assert [c for c, _ in results] == [cid]
    res = results[0][1]
    diverged = [p for p in RunDir(root).load_cell(cid).diff.pairs if p.position is not None]
    assert res.pairs and {p.key for p in res.pairs} == {p.key for p in diverged}
    assert all(p.kind and p.cause for p in res.pairs)
    ex = root / "cells" / cid / "explain"
    for config in ("engine", "deterministic", "fp32"):
        assert (ex / f"variants-{config}.h5").is_file()
    assert [r.engine_id for r in records] == [
        "ref.bf16.cache-on",
        "ref-deterministic.bf16.cache-on",
        "ref-fp32.fp32.cache-on",
    ]
    meta = [r.self_report["v1_models"]["data"][0]["meta"] for r in records]
    assert [x["batch_invariant"] for x in meta] == [False, True, False] and meta[2]["dtype"] == "fp32"
    assert all(r.exit_code is not None for r in records)  # stopped
    rep = write_report(root, plots=False)
    assert f"### Cause of each flip ({summary_line(res).split(' · ')[0]}" in rep.markdown
    for p in res.pairs:
        assert re.search(rf"\| {re.escape(p.key)} +\|", rep.markdown.split("### Cause of each flip")[1])
    doc = json.loads((root / "report" / "summary.json").read_text())
    counts = doc["explain"]["counts"]
    assert counts["pairs"] == len(res.pairs) and {k: v for k, v in counts.items() if k != "pairs"} == res.counts()
    assert {q["key"] for q in doc["explain"]["cells"][0]["pairs"]} == {p.key for p in res.pairs}
