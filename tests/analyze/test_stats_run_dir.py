"""`tracekit stats RUN_DIR` (issue 26: stats accepts a run directory, a merged one too): per
serial-baseline group, its serial capture and its bursts pooled as repeats of the same prompts.
Read from the committed demo run (traces/demo), so every number here is that run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "traces/demo"


def tk(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tracekit", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)  # fmt: skip


def test_stats_of_a_run_directory_is_per_group():
    p = tk("stats", DEMO, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "tracekit.stats-run/1"
    cells = [json.loads((c / "cell.json").read_text()) for c in sorted((DEMO / "cells").iterdir())]
    want: dict[str, list[str]] = {}
    for c in cells:
        want.setdefault(c["cell"]["group_id"], [str(DEMO / c["baseline"])]).append(str(DEMO / c["burst"]))
    got = {g["group"]: g for g in doc["groups"]}
    assert {k: sorted(g["paths"]) for k, g in got.items()} == {k: sorted(v) for k, v in want.items()}
    for gid, g in got.items():
        n_prompts = g["prompts_total"]
        assert g["completions"] == n_prompts * len(want[gid])  # one completion per prompt per trace
        if ".fp32." in gid:  # FP32: serial and every burst give the same tokens (the demo's N/N)
            assert g["unique"] == n_prompts and g["prompts_split"] == 0, gid
    text = tk("stats", DEMO)
    assert text.returncode == 0 and text.stdout.count("## group ") == len(want)


def test_a_run_directory_is_given_alone():
    p = tk("stats", DEMO, DEMO / "groups" / next(iter(sorted(os.listdir(DEMO / "groups")))) / "serial.h5")
    assert p.returncode == 2 and "run directory is given alone" in p.stderr
