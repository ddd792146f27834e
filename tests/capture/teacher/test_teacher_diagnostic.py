"""cli_run end to end: prompt files and traces in, a teacher-forced trace out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tracekit.capture.teacher import TeacherConfig, run_teacher
from tracekit.errors import ConfigError, TracekitError
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns
from tracekit.store import TraceReader, TraceWriter


def _prompts(tmp_path, n=4):
    rng = np.random.default_rng(0)
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": f"p{i}", "prompt": rng.integers(1, 512, 12 + 4 * (i % 2)).tolist()} for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_prompts_to_trace_one_row_per_sequence_history_dtype(random_model_dir, tmp_path):
    out = tmp_path / "diag.h5"
    s = run_teacher(
        TeacherConfig(
            model_dir=str(random_model_dir),
            prompts=str(_prompts(tmp_path)),
            max_tokens=6,
            history="full,prefix:5,chunked:4,decode",
            dtype="fp32,bf16",
            top_logprobs=5,
            full_logits=True,
            out=str(out),
        )
    )
    assert (s.sequences, s.rows) == (4, 4 * 4 * 2)
    with TraceReader(out) as r:
        assert r.meta.source == "teacher_forced"
        assert r.layout == Layout(topk=5, raw_logits=True, vocab_size=512)
        t = r.requests
        assert sorted(set(zip(t.history, t.dtype))) == sorted(
            (h, d) for h in ("full", "prefix:5", "chunked:4", "decode") for d in ("fp32", "bf16")
        )
        assert set(t.key) == {"p0", "p1", "p2", "p3"}
        assert list(t.cached_tokens[t.history == "prefix:5"]) == [5] * 8
        assert r.meta.run["eos_token_ids"] == [0]
        for i in range(len(t)):
            cols = r.tokens(i, full_logits=True)
            assert len(cols) == t.n_tokens[i] == 6 or cols.token_id[-1] == 0  # max tokens or EOS
            # chosen logprob, top-k and raw logits all come from the same full logits
            lp = (
                cols.logits
                - np.log(np.exp(cols.logits - cols.logits.max(1, keepdims=True)).sum(1, keepdims=True))
                - cols.logits.max(1, keepdims=True)
            )
            rows = np.arange(len(cols))
            np.testing.assert_allclose(cols.logprob, lp[rows, cols.token_id], atol=1e-5)
            # (BF16 logits tie often: compare the value, not which tied id comes first)
            np.testing.assert_array_equal(cols.topk_logit[:, 0], cols.logits.max(1))
            np.testing.assert_array_equal(cols.topk_logit, np.take_along_axis(cols.logits, cols.topk_id, 1))
            assert np.all(np.diff(cols.topk_logit, axis=1) <= 0)
        # the generated tokens are the FP32 greedy choices, the same in every row of a key
        fp32_full = [i for i in range(len(t)) if t.history[i] == "full" and t.dtype[i] == "fp32"]
        for i in fp32_full:
            cols = r.tokens(i)
            np.testing.assert_array_equal(cols.token_id, cols.topk_id[:, 0])


def _source_trace(path, seqs):
    """An HTTP-like trace: (key, prompt ids, generated ids, cached_tokens, status)."""
    meta = RunMeta(source="http", run={"model": "x"}, layout=Layout(topk=1))
    with TraceWriter(path, meta) as w:
        for key, pids, gen, cached, status in seqs:
            n = len(gen)
            cols = TokenColumns(gen, np.zeros(n), np.zeros(n), np.array(gen)[:, None], np.zeros((n, 1)))
            w.append(
                RequestRecord(
                    key=key, prompt_hash="h" + key, status=status, cached_tokens=cached, finish_reason="length"
                ),
                cols,
                pids,
            )


def test_from_trace_prefix_auto_uses_reported_cached_tokens(random_model_dir, tmp_path):
    src = tmp_path / "run.h5"
    _source_trace(
        src,
        [
            ("a", list(range(1, 21)), [5, 6, 7, 8], 16, "ok"),
            ("b", list(range(2, 22)), [9, 9, 9], -1, "ok"),
            ("c", list(range(3, 23)), [1, 2], 8, "error"),
            ("d", list(range(4, 24)), [3, 4, 5, 6], 8, "ok"),
        ],
    )
    out = tmp_path / "diag.h5"
    s = run_teacher(
        TeacherConfig(
            model_dir=str(random_model_dir), from_path=str(src), history="full,prefix:auto", dtype="fp32", out=str(out)
        )
    )
    # No boundary reported: said, with why, not guessed.
    assert s.skipped == [
        "b prefix:auto (the trace holds no cached-token count for this request (-1: not reported); give prefix:B)"
    ]
    with TraceReader(out) as r:
        t = r.requests
        got = sorted(zip(t.key, t.history, t.cached_tokens.tolist()))
        assert got == [
            ("a", "full", 0),
            ("a", "prefix:16", 16),
            ("b", "full", 0),
            ("d", "full", 0),
            ("d", "prefix:8", 8),
        ]
        i = list(t.key).index("a")
        np.testing.assert_array_equal(r.prompt_ids(i), np.arange(1, 21))
        np.testing.assert_array_equal(r.tokens(i).token_id, [5, 6, 7, 8])
        assert t.prompt_hash[i] == "ha" and t.finish_reason[i] == "length"
    s = run_teacher(
        TeacherConfig(
            model_dir=str(random_model_dir),
            from_path=str(src),
            keys="d",
            history="decode",
            dtype="bf16",
            out=str(tmp_path / "d.h5"),
        )
    )
    assert s.rows == 1
    with pytest.raises(ConfigError, match="no request with key 'zz'"):
        run_teacher(
            TeacherConfig(model_dir=str(random_model_dir), from_path=str(src), keys="d,zz", out=str(tmp_path / "e.h5"))
        )


def test_full_logits_over_1gb_refused_with_the_size(random_model_dir, tmp_path):
    # 4 prompts x 200,000 tokens x 2 histories x 512 ids x 4 B = 3.28 GB, refused before generating
    with pytest.raises(ConfigError, match=r"3\.28 GB .*--force"):
        run_teacher(
            TeacherConfig(
                model_dir=str(random_model_dir),
                prompts=str(_prompts(tmp_path)),
                max_tokens=200_000,
                history="full,decode",
                full_logits=True,
                out=str(tmp_path / "x.h5"),
            )
        )
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize(
    "opts, msg",
    [
        ({}, "exactly one of --from"),
        ({"prompts": "p.jsonl"}, "--max-tokens"),
        ({"prompts": "nope.jsonl", "max_tokens": 3}, "no such prompt file"),
        ({"from_path": "nope.h5"}, "no such file"),
        (
            {"prompts": "p.jsonl", "max_tokens": 3, "attn": "flash"},
            "expected one of sdpa, eager, sdpa_lower_right, auto",
        ),
        ({"prompts": "p.jsonl", "max_tokens": 3, "keys": "a"}, "--keys selects requests of --from"),
    ],
)
def test_bad_options_are_config_errors(random_model_dir, tmp_path, monkeypatch, opts, msg):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TracekitError, match=msg):  # the CLI prints each as one `Error:` line
        run_teacher(TeacherConfig(model_dir=str(random_model_dir), out="o.h5", **opts))


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="not an HF model directory"):
        run_teacher(TeacherConfig(model_dir=str(tmp_path), prompts="p.jsonl", max_tokens=2, out=str(tmp_path / "o.h5")))


def test_device_errors_are_one_line(random_model_dir, tmp_path):
    """No CUDA (or no accelerate for --device auto) is a clear ConfigError, not a torch traceback."""
    import importlib.util

    import torch

    cases = []
    if not torch.cuda.is_available():
        cases.append(("cuda", "no CUDA device"))
    if importlib.util.find_spec("accelerate") is None:
        cases.append(("auto", "needs the accelerate"))
    if not cases:
        pytest.skip("CUDA and accelerate both present")
    for device, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            run_teacher(
                TeacherConfig(
                    model_dir=str(random_model_dir),
                    prompts=str(_prompts(tmp_path, 1)),
                    max_tokens=2,
                    device=device,
                    out=str(tmp_path / "o.h5"),
                )
            )


def test_batching_equal_lengths_matches_one_by_one(random_model_dir, tmp_path):
    """Equal-length sequences share a forward; in FP32 that must not move a
    logprob by more than rounding (one-by-one is batch_tokens=1)."""
    from tracekit.capture.teacher import DiagnosticConfig, TokenSequence, parse_histories, run_diagnostic

    rng = np.random.default_rng(3)
    seqs = [TokenSequence(f"s{i}", rng.integers(1, 512, 20), rng.integers(1, 512, 6), f"h{i}") for i in range(5)]
    hist = parse_histories("full,prefix:9,chunked:4,decode")
    got = {}
    for name, bt in (("batched", 1 << 15), ("single", 1)):
        cfg = DiagnosticConfig(
            model_dir=str(random_model_dir), histories=hist, dtypes=("fp32",), topk=4, batch_tokens=bt
        )
        run_diagnostic(cfg, seqs, str(tmp_path / f"{name}.h5"))
        with TraceReader(tmp_path / f"{name}.h5") as r:
            got[name] = {(r.requests.key[i], r.requests.history[i]): r.tokens(i) for i in range(len(r))}
    assert got["batched"].keys() == got["single"].keys() and len(got["single"]) == 20
    for k, a in got["batched"].items():
        b = got["single"][k]
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-6, err_msg=str(k))
        np.testing.assert_array_equal(a.topk_id[:, 0], b.topk_id[:, 0])
