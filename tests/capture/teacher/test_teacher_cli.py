"""`tracekit capture --teacher-forced` through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tracekit.store import TraceReader

REPO = Path(__file__).resolve().parents[3]


def _tracekit(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )


def test_cli_prompts_json_summary_and_clean_stdout(random_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": [5, 6, 7, 8, 9, 10]}\n{"id": "b", "prompt": [11, 12, 13, 14, 15, 16]}\n')
    out = tmp_path / "diag.h5"
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        prompts,
        "--max-tokens",
        4,
        "--history",
        "full,prefix:3,decode",
        "--dtype",
        "fp32,bf16",
        "--top-logprobs",
        3,
        "--out",
        out,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert summary["rows"] == 2 * 3 * 2 and summary["out"] == str(out)
    assert summary["prefix_segments"]["verified"] >= 1  # prefix's [0, 3) and decode's prefill vs full's forward
    with TraceReader(out) as t:
        assert t.meta.source == "teacher_forced" and t.layout.topk == 3 and t.layout.raw_logits
        assert t.meta.run["histories"] == ["full", "prefix:3", "decode"]
        assert t.meta.run["prefix_reuse"] is True
        on = [t.tokens(i) for i in range(len(t.requests))]
    off_out = tmp_path / "diag_off.h5"
    args = ["--prompts", prompts, "--max-tokens", 4, "--history", "full,prefix:3,decode", "--dtype", "fp32,bf16"]
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        *args,
        "--top-logprobs",
        3,
        "--out",
        off_out,
        "--json",
        "--no-prefix-reuse",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prefix_segments"] == {"reused": 0, "verified": 0, "failed": 0}
    with TraceReader(off_out) as t:
        assert t.meta.run["prefix_reuse"] is False
        off = [t.tokens(i) for i in range(len(t.requests))]
    for a, b in zip(on, off, strict=True):  # the same rows, bit for bit
        assert a.topk_logit.tobytes() == b.topk_logit.tobytes() and a.logprob.tobytes() == b.logprob.tobytes()


def test_cli_errors(random_model_dir, tmp_path):
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        tmp_path / "none.jsonl",
        "--out",
        tmp_path / "o.h5",
    )
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "no such prompt file" in r.stderr  # usage: exit 2
    assert "Traceback" not in r.stderr
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        "x.jsonl",
        "--history",
        "prefix:x",
        "--out",
        tmp_path / "o.h5",
    )
    assert r.returncode == 3 and "bad history 'prefix:x'" in r.stderr
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        "x.jsonl",
        "--concurrency",
        4,
        "--out",
        tmp_path / "o.h5",
    )
    assert r.returncode == 2 and "--concurrency: only with --http" in r.stderr
    r = _tracekit(
        "capture",
        "--http",
        "http://127.0.0.1:9",
        "--prompts",
        "x.jsonl",
        "--no-cuda-graphs",
        "--out",
        tmp_path / "o.h5",
    )
    assert r.returncode == 2 and "--no-cuda-graphs: only with --teacher-forced" in r.stderr


def test_cli_attn_auto_resolves_to_sdpa_on_cpu(random_model_dir, tmp_path):
    """`--attn auto` picks the flash-keeping kernel on CUDA only; on CPU the trace must
    record plain sdpa, so histories captured here compare with CPU captures."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": [3, 4, 5, 6, 7, 8]}\n')
    out = tmp_path / "d.h5"
    r = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        prompts,
        "--max-tokens",
        "3",
        "--history",
        "full,prefix:2",
        "--attn",
        "auto",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    with TraceReader(out) as t:
        assert t.meta.run["attn"] == "sdpa"
        assert t.meta.run["cuda_graphs"] is False  # a CPU run never uses them
        assert sorted(t.requests.history) == ["full", "prefix:2"]
    bad = _tracekit(
        "capture",
        "--teacher-forced",
        random_model_dir,
        "--prompts",
        prompts,
        "--max-tokens",
        "3",
        "--attn",
        "flash9",
        "--out",
        tmp_path / "x.h5",
    )
    assert bad.returncode == 2 and "flash9" in bad.stderr
