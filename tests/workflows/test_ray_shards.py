"""Two shards of a small matrix as Ray tasks on a local Ray cluster (workflows/ray_shards.py),
merged into one report. Ray is an optional extra: skipped where it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_two_shards_as_ray_tasks_merge_into_one_report(tmp_path):
    m = tmp_path / "m.toml"  # two engine configurations (cache on / off): shards 1 and 0
    m.write_text(
        'name = "ray-small"\n[run]\ntimeout_s = 120\nready_timeout_s = 120\n'
        f'[[prompts]]\nname = "p"\npath = "{ROOT}/fixtures/prompts/cpu_small.jsonl"\n'
        '[axes]\nconcurrency = [4]\ndtype = ["fp32"]\nprefix_cache = [true, false]\noutput_tokens = [8]\n'
        '[[target]]\nname = "ref"\nserve = ["--threads", "1", "--slots", "4"]\n'
    )
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "tracekit.workflows.ray_shards", m, "--out", out, "--shards", "2", "--num-cpus", "2"]
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    for i in range(2):
        assert f"shard {i}/2 on " in p.stderr and f"shard {i}/2" in (out / f"shard-{i}/report/report.md").read_text()
        assert (
            json.loads((out / f"shard-{i}/shard.json").read_text())["cells"]
            == [
                ["ref.fp32.cache-off.p.out8.c4"],
                ["ref.fp32.cache-on.p.out8.c4"],
            ][i]
        )
    doc = json.loads((out / "merged/report/summary.json").read_text())
    assert [c["id"] for c in doc["cells"]] == ["ref.fp32.cache-on.p.out8.c4", "ref.fp32.cache-off.p.out8.c4"]
    assert doc["shards"]["given"] == [0, 1] and doc["shards"]["missing_cells"] == []
    assert doc["totals"]["passed"] == 2 and all(c["equality"] == "8/8" for c in doc["cells"])  # FP32: N/N
