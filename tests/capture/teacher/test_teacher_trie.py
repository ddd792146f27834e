"""The runner: history numerics, and that sharing work never changes a number."""

from __future__ import annotations

import pytest

from tracekit.capture.teacher.history import parse_histories
from tracekit.capture.teacher.model import load_model
from tracekit.capture.teacher.trie import run_histories

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
        plain = lm.model(input_ids=ids[:, :-1], use_cache=False).logits[:, p - 1 :]  # [N, G, V]
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


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lower_right_attention_is_bitwise_sdpa_on_cpu(random_model_dir, dtype):
    """`sdpa_lower_right` only changes which CUDA kernel a segment on a cache
    runs (flash instead of a masked kernel); on CPU it must be exactly sdpa."""
    import torch

    ids, p, g = _batch(n=2, p=40, g=16)
    hists = _resolve(p, g, "full,prefix:17,chunked:7,decode")
    out = {
        attn: run_histories(load_model(str(random_model_dir), dtype, attn=attn), ids[:, :-1], p - 1, hists)
        for attn in ("sdpa", "sdpa_lower_right")
    }
    for h in hists:
        assert torch.equal(out["sdpa"][h.label], out["sdpa_lower_right"][h.label]), h.label


def test_lower_right_attention_with_padding_takes_transformers_mask(random_model_dir):
    """A padded batch (never built by the diagnostic) must still be right: the
    mask goes to transformers' own sdpa path."""
    import torch

    ids, _, _ = _batch(n=2, p=20, g=4)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding on row 0
    logits = {}
    for attn in ("sdpa", "sdpa_lower_right"):
        lm = load_model(str(random_model_dir), "fp32", attn=attn)
        with torch.inference_mode():
            logits[attn] = lm.model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits["sdpa"], logits["sdpa_lower_right"])
    with torch.inference_mode():
        unpadded = lm.model(input_ids=ids).logits
    assert (unpadded[0] - logits["sdpa"][0]).abs().max().item() > 1e-3  # the mask did something


def test_decode_over_a_thousand_tokens_agrees_with_full(random_model_dir):
    """`decode` is a chain of G single-token segments, run from a work stack
    (no recursion per token); 1000 of them still reproduce `full` in FP32."""
    import torch

    ids, p, g = _batch(n=1, p=8, g=1000)
    out = run_histories(load_model(str(random_model_dir), "fp32"), ids[:, :-1], p - 1, _resolve(p, g, "full,decode"))
    assert out["decode"].shape == out["full"].shape == (1, g, 512)
    assert (out["decode"] - out["full"]).abs().max().item() < 1e-5
    assert torch.equal(out["decode"].argmax(-1), out["full"].argmax(-1))


def test_lower_right_mask_lets_the_last_query_see_every_key():
    """The segment-on-a-cache case against attention written out by hand:
    query i of q attends to keys 0 .. kv-q+i (lower-right alignment); an
    upper-left mask would hide the cached prefix from the first queries."""
    import torch

    from tracekit.capture.teacher.attention import lower_right_sdpa

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen, dtype=torch.float64) for h, n in ((4, 5), (2, 9), (2, 9)))
    out, _ = lower_right_sdpa(Attn(), q, k, v, None, scaling=0.25)  # [1, 5, 4, 16]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # [1, 4, 9, 16]
    scores = q @ kk.transpose(-1, -2) * 0.25  # [1, 4, 5, 9]
    allowed = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + (9 - 5)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vv
    assert (out - ref.transpose(1, 2)).abs().max().item() < 1e-12


def test_square_path_is_lower_right_attention():
    """The CUDA square path (padded queries, square causal call, last q rows),
    run here on CPU in FP64 against attention written out by hand, for
    queries in transformers' layout ([N, q, H, D] in memory) and contiguous."""
    import torch

    from tracekit.capture.teacher.attention import _square

    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    allowed = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + (9 - 5)
    for q in (
        torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float64).transpose(1, 2),
        torch.randn(2, 4, 5, 16, generator=gen, dtype=torch.float64),
    ):
        out = _square(q, k, v, 0.0, 0.25, 2)  # [2, 5, 4, 16]
        scores = (q @ kk.transpose(-1, -2) * 0.25).masked_fill(~allowed, float("-inf"))
        ref = (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2)
        assert out.shape == (2, 5, 4, 16) and out.is_contiguous()
        assert (out - ref).abs().max().item() < 1e-12
