"""A matrix cell (`tracekit run`) whose target is a running llama-server: serial baseline, a burst
at concurrency 4, the diff and the lifecycle checks (cancel_drain from llama.cpp's /metrics). The
target names the served model's `tokenizer` (issue 24, item 5: a target that is not `serve` had
no way to give EOS ids, and every llama.cpp cell warned "EOS ids unknown")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MATRIX = """
name = "llama"
[run]
ignore_eos = true
top_logprobs = 5
timeout_s = 120
ready_timeout_s = 60
[checks]
cancel_after_tokens = 4
drain_timeout_s = 10
[[prompts]]
name = "cpu_small"
path = "{prompts}"
input_tokens = "40-61"
[axes]
concurrency = [4]
output_tokens = [32]
[[target]]
name = "llama-server"
url = "{url}"
tokenizer = "{tokenizer}"
dtype = ["fp32"]
prefix_cache = [true]
"""


def test_matrix_cell_with_a_llama_server_target(llama, tmp_path):
    toml = tmp_path / "llama.toml"
    tokenizer = ROOT / "fixtures" / "models" / "tiny"
    toml.write_text(
        MATRIX.format(prompts=ROOT / "fixtures" / "prompts" / "cpu_small.jsonl", url=llama.url, tokenizer=tokenizer)
    )
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "run", str(toml), "--out", str(tmp_path / "run"), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 0, p.stderr
    (cell,) = json.loads(p.stdout)["cells"]
    assert cell["failed_checks"] == [], cell["checks"]
    assert cell["checks"]["cancel_drain"] == "pass" and cell["checks"]["prefix_cache"] == "pass", cell["checks"]
    assert cell["classes"]["incomparable"] == 0 and cell["classes"]["unexplained"] == 0, cell["classes"]
    from tracekit.store import TraceReader

    for trace in sorted((tmp_path / "run").rglob("*.h5")):
        with TraceReader(trace) as r:
            run = r.meta.run
            assert run["eos_token_ids"] == [0] and run["tokenizer"] == str(tokenizer), trace
            assert "eos_unknown" not in {p["code"] for p in run["pitfalls"]}, run["pitfalls"]
