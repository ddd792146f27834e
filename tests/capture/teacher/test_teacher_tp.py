"""`tracekit capture --teacher-forced ... --tp N`: the real command line, N gloo ranks on CPU.

The fixture model (fixtures/models/tiny, a trained Qwen3: 4 attention heads, 2 key/value heads,
a vocabulary of 2048) splits over 2 ranks under transformers' own plan, so it is used as is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tracekit.analyze.compare import diff
from tracekit.capture.teacher import TeacherConfig, run_teacher, tp
from tracekit.errors import ConfigError
from tracekit.store import TraceReader

REPO = Path(__file__).resolve().parents[3]
PROMPTS = REPO / "fixtures" / "prompts" / "cpu_small.jsonl"
HISTORIES = ("full", "prefix:5", "chunked:8", "decode")
# FP32 logits of the fixture model are ~10 in magnitude (one FP32 step: ~1e-6); the
# histories of one process agree with `full` to 1.05e-5 (docs/diagnostic.md), and TP=2
# changes the order of the row-parallel sums the same way.
FP32_LOGIT_TOL = 2e-5


def _tracekit(*args):
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def _rows(path: Path) -> tuple[dict, dict]:
    """{(key, history, dtype): (token_id, topk_id, topk_logit, params)} and the run metadata."""
    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            c = r.tokens(i)
            out[(t.key[i], t.history[i], t.dtype[i])] = (c.token_id, c.topk_id, c.topk_logit, json.loads(t.params[i]))
        return out, dict(r.meta.run)


def _max_logit_delta(ids_a, lg_a, ids_b, lg_b) -> float:
    """max |logit_A(id) - logit_B(id)| over the ids in both top-k rows of each position."""
    worst = 0.0
    for ia, la, ib, lb in zip(ids_a, lg_a, ids_b, lg_b):
        common, xa, xb = np.intersect1d(ia, ib, return_indices=True)
        assert len(common) >= len(ia) - 2  # the two top-k lists are nearly the same ids
        worst = max(worst, float(np.abs(la[xa] - lb[xb]).max()))
    return worst


@pytest.fixture(scope="module")
def tp_runs(fixture_model_dir, tmp_path_factory):
    """The same command with --tp 1 and --tp 2 (each generates its greedy FP32 tokens itself)."""
    pytest.importorskip("accelerate", reason="transformers' tensor-parallel loading needs accelerate")
    d = tmp_path_factory.mktemp("tp")
    runs = {}
    for n in (1, 2):
        out = d / f"tp{n}.h5"
        t0 = time.perf_counter()
        r = _tracekit(
            "capture",
            "--teacher-forced",
            fixture_model_dir,
            "--prompts",
            PROMPTS,
            "--max-tokens",
            8,
            "--history",
            ",".join(HISTORIES),
            "--dtype",
            "fp32",
            "--tp",
            n,
            "--out",
            out,
            "--json",
        )
        assert r.returncode == 0, r.stderr
        runs[n] = (out, json.loads(r.stdout), time.perf_counter() - t0)
    return runs


@pytest.mark.slow
def test_tp2_rows_match_tp1_in_fp32(tp_runs):
    """TP=2 changes only the order of the row-parallel reductions: in FP32 every row must have the
    same key, history and tokens as TP=1, logits within FP32 noise, and the same top-1 everywhere;
    and the trace must say which TP size made it."""
    (p1, s1, _), (p2, s2, _) = tp_runs[1], tp_runs[2]
    assert s1["rows"] == s2["rows"] == 8 * len(HISTORIES)
    a, run_a = _rows(p1)
    b, run_b = _rows(p2)
    assert sorted(a) == sorted(b) and len(a) == 8 * len(HISTORIES)
    assert run_a["tp"] == 1 and "tp_backend" not in run_a
    assert run_b["tp"] == 2 and run_b["tp_backend"] == "gloo" and run_b["tp_devices"] == ["cpu", "cpu"]
    assert run_b["cuda_graphs"] is False
    worst = 0.0
    for k in a:
        tok_a, ids_a, lg_a, params_a = a[k]
        tok_b, ids_b, lg_b, params_b = b[k]
        assert params_a["tp"] == 1 and params_b["tp"] == 2
        np.testing.assert_array_equal(tok_a, tok_b)  # each side's own greedy tokens: the same
        np.testing.assert_array_equal(ids_a[:, 0], ids_b[:, 0])  # the same top-1 at every position
        worst = max(worst, _max_logit_delta(ids_a, lg_a, ids_b, lg_b))
    assert worst <= FP32_LOGIT_TOL, worst
    t1, t2 = tp_runs[1][2], tp_runs[2][2]
    print(f"\nTP=1 vs TP=2, FP32: max |dlogit| {worst:.3g} over {len(a)} rows; wall {t1:.1f} s vs {t2:.1f} s")


@pytest.mark.slow
def test_diff_classifies_tp1_vs_tp2(tp_runs):
    """`tracekit diff tp1.h5 tp2.h5` per history: FP32 TP=2 is N/N identical against TP=1 (no
    benign excuse needed, nothing unexplained)."""
    p1, p2 = tp_runs[1][0], tp_runs[2][0]
    for h in HISTORIES:
        sel = f"history={h},dtype=fp32"
        res = diff(p1, p2, a_select=sel, b_select=sel)
        c = res.counts()
        assert c["pairs"] == 8 and c["identical"] == 8, (h, c)
        assert res.ok
    r = _tracekit("diff", p1, p2, "--a-select", "history=decode", "--b-select", "history=decode")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8/8 identical" in r.stdout


@pytest.mark.slow
def test_rank_error_comes_back_as_one_line(tp_runs, fixture_model_dir, tmp_path):
    """A bad option that only the ranks can see (an unknown key of --from) is the ranks'
    ConfigError, printed once as `Error:` by the command that started them, exit 3; no file."""
    out = tmp_path / "x.h5"
    r = _tracekit(
        "capture", "--teacher-forced", fixture_model_dir, "--from", tp_runs[1][0], "--keys", "nosuch", "--tp", 2,
        "--out", out,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [errors[0]] and "no request with key 'nosuch'" in errors[0]
    assert "Traceback" not in r.stderr and not out.exists()


def test_tp_not_dividing_heads_is_one_line_before_any_rank(fixture_model_dir, tmp_path):
    """tp must split whole heads: 3 does not divide the fixture's 4 heads; the error names the
    sizes that fit, exit 3, and no rank is started."""
    pytest.importorskip("accelerate")
    r = _tracekit(
        "capture", "--teacher-forced", fixture_model_dir, "--prompts", PROMPTS, "--max-tokens", 2, "--tp", 3,
        "--out", tmp_path / "x.h5",
    )  # fmt: skip
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: --tp 3: the model has 4 attention heads, 2 key/value heads and a vocabulary of 2048; "
        "tp must divide all three (here --tp 1 or 2)"
    )


def _opts(model_dir, tmp_path, **kw):
    base = dict(model_dir=str(model_dir), out=str(tmp_path / "x.h5"), prompts=str(PROMPTS), max_tokens=2)
    return {**base, **kw}


def test_architecture_without_tp_plan(tmp_path):
    """GPT-2's config class has no base_model_tp_plan in transformers: say so, suggest --tp 1."""
    pytest.importorskip("accelerate")
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"no tensor-parallel plan for gpt2 .*run it with --tp 1"):
        tp.check_plan(str(tmp_path), 2)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp=2, tp_backend="nccl"), "nccl runs on CUDA only"),
        (dict(tp=2, device="auto"), "places rank r on cuda:r"),
        (dict(tp=2, device="cuda:1"), "places rank r on cuda:r"),
        (dict(tp=0), "--tp must be >= 1"),
        (dict(tp=1, tp_backend="gloo"), "--tp-backend is the backend of --tp N"),
    ],
)
def test_option_errors(fixture_model_dir, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        run_teacher(TeacherConfig(**_opts(fixture_model_dir, tmp_path, **kw)))
    assert not (tmp_path / "x.h5").exists()


def test_no_cuda_for_tp_on_cuda(fixture_model_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        run_teacher(TeacherConfig(**_opts(fixture_model_dir, tmp_path, tp=2, device="cuda")))
