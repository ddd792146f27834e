"""End to end: real captures from the reference engine (`tracekit serve`, tiny
model, CPU, 127.0.0.1:0) diffed with the real CLI.

- FP32, serial vs concurrent: every pair identical, exit 0.
- BF16 with the prefix cache on, serial vs concurrent (padded batched decode):
  at least one divergence, classified benign with its evidence.
- The engine's injected fault (corrupt-prefix-cache): `unexplained`, exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.engine.process import start_engine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"  # 8 prompts of different lengths, shared prefix
MODEL = ROOT / "fixtures" / "models" / "tiny"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
pytestmark = pytest.mark.slow


def tk(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
    )


def capture_pair(tmp: Path, name: str, *engine_args: str) -> tuple[Path, Path]:
    """Start an engine, capture the prompt set concurrently (cold cache) then serially; stop it."""
    out = {}
    with start_engine(["--threads", "1", "--slots", "8", *engine_args]) as eng:
        for mode, c in (("concurrent", 8), ("serial", 1)):
            out[mode] = tmp / f"{name}_{mode}.h5"
            p = tk(
                "capture",
                "--http",
                eng.url,
                "--prompts",
                PROMPTS,
                "--out",
                out[mode],
                "--concurrency",
                c,
                "--ignore-eos",
                "--json",
            )
            assert p.returncode == 0, p.stderr
    return out["serial"], out["concurrent"]


def diff_json(*args) -> tuple[int, dict]:
    p = tk("diff", *args, "--json")
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return capture_pair(tmp_path_factory.mktemp("fp32"), "fp32", "--dtype", "fp32")


def test_fp32_serial_vs_concurrent_all_identical(fp32):
    rc, d = diff_json(*fp32)
    assert rc == 0
    assert d["summary"]["identical"] == d["summary"]["pairs"] == 8
    assert all(p["drift_max"] < 1e-3 for p in d["pairs"])


def test_bf16_prefix_reuse_divergence_is_classified_with_evidence(tmp_path):
    serial, conc = capture_pair(tmp_path, "bf16", "--dtype", "bf16")
    rc, d = diff_json(serial, conc)
    div = [p for p in d["pairs"] if p["class"] != "identical"]
    assert div, f"no divergence in BF16 serial vs concurrent: {d['summary']}"
    assert rc == 0 and d["summary"]["unexplained"] == d["summary"]["incomparable"] == 0
    for p in div:
        assert p["class"] in ("bf16_tie_flip", "cache_boundary"), p
        assert p["position"] is not None and p["token_a"] != p["token_b"]
        # Raw logits were captured: gaps in ULPs, within the tie / drift tolerance.
        assert p["gap_a_ulp"] is not None and p["gap_b_ulp"] is not None
        assert max(abs(p["gap_a"]), abs(p["gap_b"])) <= 0.5 and p["drift_max"] <= 0.5
        assert p["boundary_a"] is not None and p["boundary_b"] is not None and p["vllm_close"] is True
    # The drill-down shows both tokens at that position.
    p = div[0]
    s = json.loads(tk("show", serial, conc, "--key", p["key"], "--json").stdout)
    assert s["position"] == p["position"]
    assert s["a"]["topk_at_position"][0]["id"] == p["token_a"]
    assert {c["id"] for c in s["b"]["topk_at_position"]} >= {p["token_a"], p["token_b"]}
    # The teacher-forced cross-check gives each divergent pair a verdict, and changes no class.
    diag = tmp_path / "diag.h5"
    g = tk(
        "capture",
        "--teacher-forced",
        MODEL,
        "--from",
        serial,
        "--keys",
        p["key"],
        "--history",
        "full,prefix:auto,decode",
        "--dtype",
        "fp32,bf16",
        "--out",
        diag,
    )
    assert g.returncode == 0, g.stderr
    rc2, d2 = diff_json(serial, conc, "--teacher-forced", diag)
    pair = next(x for x in d2["pairs"] if x["key"] == p["key"])
    assert pair["class"] == p["class"] and pair["teacher"].startswith(("reproduced by", "not reproduced"))


def test_injected_fault_is_unexplained_and_exits_1(fp32, tmp_path):
    serial, _ = fp32
    faulty, _ = capture_pair(tmp_path, "fault", "--dtype", "fp32", "--inject-fault", "corrupt-prefix-cache")
    rc, d = diff_json(serial, faulty)
    assert rc == 1 and d["summary"]["unexplained"] >= 1
    bad = [p for p in d["pairs"] if p["class"] == "unexplained"]
    assert all(p["boundary_a"] and p["boundary_b"] for p in bad)  # every corrupted pair reused a prefix
    assert tk("diff", serial, faulty).returncode == 1
