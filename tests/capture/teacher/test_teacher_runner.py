"""The runner: history numerics, and that sharing work never changes a number."""

from __future__ import annotations

import pytest

from capture.teacher.history import parse_histories
from capture.teacher.runner import load_model, run_histories

HISTORIES = "full,prefix:7,prefix:24,chunked:7,chunked:24,decode"


def _batch(n=3, p=24, g=12, vocab=512, seed=1):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, p + g), generator=gen), p, g


def _resolve(p, g, text=HISTORIES):
    return [s.resolve(p, g) for s in parse_histories(text)]


def test_fp32_histories_agree_with_a_plain_forward(random_model_dir):
    """FP32 is the control: every cache history must reproduce one plain
    forward to ~1e-5 and never change the argmax, or the runner is wrong."""
    import torch

    lm = load_model(str(random_model_dir), "fp32")
    ids, p, g = _batch()
    out = run_histories(lm, ids[:, :-1], p - 1, _resolve(p, g))
    with torch.inference_mode():
        plain = lm.model(input_ids=ids[:, :-1], use_cache=False).logits[:, p - 1:]   # [N, G, V]
    assert set(out) == {"full", "prefix:7", "prefix:24", "chunked:7", "chunked:24", "decode"}
    for label, logits in out.items():
        assert logits.shape == plain.shape, label
        assert (logits - plain).abs().max().item() < 1e-5, label
        assert torch.equal(logits.argmax(-1), plain.argmax(-1)), label


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_shared_prefixes_are_bitwise_identical_to_running_each_history_alone(random_model_dir, dtype):
    """The trie shares a forward between histories only when it is the same
    computation; a forked cache must not leak one branch into another."""
    import torch

    lm = load_model(str(random_model_dir), dtype)
    ids, p, g = _batch(n=2)
    hists = _resolve(p, g)
    shared = run_histories(lm, ids[:, :-1], p - 1, hists)
    for h in hists:
        alone = run_histories(lm, ids[:, :-1], p - 1, [h])[h.label]
        assert torch.equal(alone, shared[h.label]), h.label


def test_bf16_histories_differ_but_fp32_do_not(random_model_dir):
    """A split prefill is a different reduction order: BF16 shows it, FP32 barely."""
    ids, p, g = _batch(n=4, p=40, g=16)
    hists = _resolve(p, g, "full,prefix:17,decode")
    gaps = {}
    for dtype in ("fp32", "bf16"):
        out = run_histories(load_model(str(random_model_dir), dtype), ids[:, :-1], p - 1, hists)
        gaps[dtype] = max((out[h.label].float() - out["full"].float()).abs().max().item() for h in hists[1:])
    assert gaps["fp32"] < 1e-5
    assert gaps["bf16"] > 1e-3
