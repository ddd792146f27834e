"""The GPU study's CPU-testable parts: models with a matching tokenizer, the B1/B4 driver,
and the cross-target comparison of `tracekit report` (analyze/compare_targets.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_study import lanes, models
from tracekit import modelinfo
from tracekit.analyze.run_report import write_report
from tracekit.capture.matrix import load_matrix
from tracekit.workflows.matrix import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["qwen3-0.6b", "gemma3-1b", "llama3-8b"])
def test_tokenizer_vocab_and_eos_match_the_config(tmp_path, name):
    """Token-id prompts and decoded outputs only round-trip when the tokenizer's vocabulary is
    exactly the config's; the engine's EOS ids come from the saved files."""
    from transformers import AutoTokenizer

    model = models.build(name, smoke=True)
    d = models.save(model, name, tmp_path, smoke=True)
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == model.config.vocab_size == models.SMOKE["vocab_size"]
    ids = [5, 17, 4095]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert modelinfo.eos_token_ids(d) == (3,)


def test_peaked_head_is_seeded_and_heavy_tailed():
    """Two builds give bitwise the same weights (fixed seed), and the LM-head row norms spread
    like exp(TAU * N(0, 1)) (the default init's rows all have one norm)."""
    import torch

    a, b = models.build("qwen3-0.6b", smoke=True), models.build("qwen3-0.6b", smoke=True)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    flat = models.build("qwen3-0.6b", smoke=True, peaked=False)
    norms = a.get_output_embeddings().weight.float().norm(dim=1)
    base = flat.get_output_embeddings().weight.float().norm(dim=1)
    spread, base_spread = norms.log().std().item(), base.log().std().item()
    assert base_spread < 0.2 < models.TAU * 0.8 < spread < models.TAU * 1.2


def test_kv_bytes_per_lane_matches_the_users_figure():
    """The user's 8B figure: 64 BF16 KV tensors of [1, 8, 9216, 128] = 1.21 GB per lane."""
    assert models.kv_bytes_per_lane("llama3-8b", 9216) == 64 * 8 * 9216 * 128 * 2 == 1_207_959_552


def test_lanes_driver_on_cpu(tmp_path):
    """One lane never decodes more than one row; the figures, the memory self-report and
    both tables come out of a real engine and a real burst."""
    doc = lanes.run_lanes(
        str(ROOT / "fixtures/models/tiny"),
        str(ROOT / "fixtures/prompts/cpu_small.jsonl"),
        tmp_path,
        slots=(1, 2),
        device="cpu",
        dtype="fp32",
        max_context=256,
        concurrency=4,
        max_tokens=8,
        timeout_s=120.0,
    )
    one, two = doc["results"]
    for r in (one, two):
        assert r["burst"]["ok"] == r["burst"]["requests"] == 8
        assert r["burst"]["failed"] == 0 and r["burst"]["tokens"] == 64
        assert r["lanes_max_running"] <= r["slots"]
        assert r["mean_decode_batch"] <= r["slots"]
        assert r["meta_after_burst"]["kv_bytes_per_slot"] == 4 * 2 * 32 * 2 * 256 * 4
    assert one["mean_decode_batch"] == 1.0 and one["lanes_check"] == "pass"
    assert json.loads((tmp_path / "lanes.json").read_text())["results"][0]["slots"] == 1
    assert "| 1 | 8/8 |" in lanes.table(doc)
    table = lanes.memory_table(doc)
    assert "| predicted (weights + N x KV/slot) |" in table and "measured fit" not in table  # CPU: no peaks
    assert lanes.lanes_that_fit(8.04e9, 1.36e9, 16.9e9) == 6


def test_report_compares_matched_cells_across_targets(tmp_path):
    """Two targets, the same cells: the report pairs them (all axes equal but the target) with
    both absolute figures and the ratio; a one-target run has no such section."""
    m = tmp_path / "two.toml"
    m.write_text(
        f"""
name = "two-targets"
[run]
top_logprobs = 5
[[prompts]]
name = "small"
path = "{ROOT / "fixtures/prompts/cpu_small.jsonl"}"
[axes]
concurrency = [4]
dtype = ["fp32"]
prefix_cache = [false]
output_tokens = [8]
[[target]]
name = "b1"
serve = ["--slots", "1", "--max-context", "256"]
[[target]]
name = "b4"
serve = ["--slots", "4", "--max-context", "256"]
"""
    )

    run(load_matrix(m), tmp_path / "run")
    rep = write_report(tmp_path / "run", plots=False)
    (entry,) = rep.summary["cross_target"]
    assert (entry["reference"], entry["other"], entry["concurrency"]) == ("b1", "b4", 4)
    tps = entry["metrics"]["tokens_per_s"]
    assert tps["b1"] > 0 and tps["b4"] > 0 and tps["ratio"] == round(tps["b4"] / tps["b1"], 3)
    assert entry["equality"] == {"b1": "8/8", "b4": "8/8"}
    assert "### Across targets (1 matched cells)" in rep.markdown
    assert "b1 → b4" in rep.markdown
