"""The acceptance numerics on the trained fixture model (fixtures/models/tiny).

FP32 is the control: every cache history must agree with one full forward to
about 1e-5 and never move the argmax. BF16 is the phenomenon: splitting the
prefill at some boundary moves a near-tied argmax, and `tracekit diff` files
that flip as benign (bf16_tie_flip or cache_boundary), never unexplained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracekit.capture.teacher import TeacherConfig, run_teacher
from tracekit.capture.teacher.history import HistorySpec
from tracekit.capture.teacher.model import load_model
from tracekit.capture.teacher.sequences import from_trace
from tracekit.capture.teacher.trie import run_histories
from tracekit.store import TraceReader

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow

PROMPTS = REPO / "fixtures" / "prompts" / "cpu_small.jsonl"
FP32_HISTORIES = ("full", "prefix:5", "prefix:16", "prefix:33", "chunked:8", "decode")


@pytest.fixture(scope="module")
def fp32_trace(fixture_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fixture") / "fp32.h5"
    run_teacher(
        TeacherConfig(
            model_dir=str(fixture_model_dir),
            prompts=str(PROMPTS),
            max_tokens=32,
            history=",".join(FP32_HISTORIES),
            dtype="fp32",
            full_logits=True,
            out=str(out),
        )
    )
    return out


def test_fp32_histories_agree_and_never_flip(fp32_trace):
    with TraceReader(fp32_trace) as r:
        t = r.requests
        full = {t.key[i]: r.tokens(i, full_logits=True) for i in range(len(t)) if t.history[i] == "full"}
        assert len(full) == 8
        worst = 0.0
        for i in range(len(t)):
            if t.history[i] == "full":
                continue
            ref, got = full[t.key[i]], r.tokens(i, full_logits=True)
            worst = max(worst, float(np.abs(got.logits - ref.logits).max()))
            np.testing.assert_array_equal(
                got.logits.argmax(1), ref.logits.argmax(1), err_msg=f"{t.key[i]} {t.history[i]}"
            )
            np.testing.assert_allclose(got.logprob, ref.logprob, atol=1e-5)
        assert sorted(set(t.history)) == sorted(FP32_HISTORIES)
    print(f"fp32 worst |dlogit| vs full: {worst:.2e}")
    assert worst < 2e-5, worst  # logits are O(10): 2e-5 is a few FP32 ULPs


def _first_bf16_prefix_flip(model_dir, seqs):
    """Search (sequence, B) in order for a BF16 prefix:B whose argmax differs from full."""
    import torch

    lm = load_model(str(model_dir), "bf16")
    for s in seqs:
        p, g = s.shape
        ids = torch.tensor([list(s.prompt_ids) + list(s.gen_ids)])[:, :-1]
        full = run_histories(lm, ids, p - 1, [HistorySpec("full").resolve(p, g)])["full"]
        for b in range(1, p):
            h = HistorySpec("prefix", b).resolve(p, g)
            got = run_histories(lm, ids, p - 1, [h])[h.label]
            if not torch.equal(got.argmax(-1), full.argmax(-1)):
                return s.key, b
    return None


def test_bf16_prefix_split_flips_an_argmax_and_diff_calls_it_benign(fixture_model_dir, fp32_trace, tmp_path):
    found = _first_bf16_prefix_flip(fixture_model_dir, from_trace(str(fp32_trace)))
    assert found is not None, "no BF16 prefix:B flip on any fixture prompt"
    key, b = found
    out = tmp_path / "bf16.h5"
    run_teacher(
        TeacherConfig(
            model_dir=str(fixture_model_dir),
            from_path=str(fp32_trace),
            keys=key,
            history=f"full,prefix:{b}",
            dtype="bf16",
            out=str(out),
        )
    )
    with TraceReader(out) as r:
        rows = {r.requests.history[i]: r.tokens(i) for i in range(len(r))}
        assert np.any(rows["full"].topk_id[:, 0] != rows[f"prefix:{b}"].topk_id[:, 0])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracekit",
            "diff",
            str(out),
            str(out),
            "--a-select",
            "history=full,dtype=bf16",
            "--b-select",
            f"history=prefix:{b},dtype=bf16",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    doc = json.loads(r.stdout)
    print(json.dumps(doc, indent=1)[:3000])
    classes = {p["class"] for p in doc["pairs"]}
    assert classes <= {"bf16_tie_flip", "cache_boundary"} and classes, classes
