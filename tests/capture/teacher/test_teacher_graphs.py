"""Decode chains as CUDA graphs with eager attention holes (capture/teacher/graphs.py).

On CPU the same patching runs inline (no graphs): it must give bitwise the
eager steps' logits under every transformers version in use. On CUDA the
graphed chain must give bitwise the eager chain's logits, and must actually
have run as graphs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tracekit.capture.teacher.graphs import STATS, NoGraph, decode_chain  # noqa: E402
from tracekit.capture.teacher.history import parse_histories  # noqa: E402
from tracekit.capture.teacher.model import resolve_attn, wrap_model  # noqa: E402
from tracekit.capture.teacher.trie import _forward, run_histories  # noqa: E402
from tracekit.hfcompat import new_dynamic_cache as new_cache  # noqa: E402

CUDA = torch.cuda.is_available()


def _model(attn: str, dtype, device: str, layers: int = 3, hidden: int = 64, head_dim: int = 16):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=resolve_attn(attn, device))
    return m.to(device).eval()


def _eager_chain(lm, ids, start: int):
    with torch.inference_mode():
        c = new_cache(lm.model)
        _forward(lm, ids[:, :start], c, 1)
        return torch.cat([_forward(lm, ids[:, p : p + 1], c, 1) for p in range(start, ids.shape[1])], 1), c


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_lower_right"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inline_chain_is_the_eager_chain(attn, dtype):
    lm = wrap_model(_model(attn, getattr(torch, dtype), "cpu"), "bf16", "cpu")
    ids = torch.randint(1, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    eager, eager_cache = _eager_chain(lm, ids, 30)
    with torch.inference_mode():
        c = new_cache(lm.model)
        _forward(lm, ids[:, :30], c, 1)
        got = decode_chain(lm, ids, 30, c, mode="inline")
    assert got.shape == (3, 10, 512)
    assert torch.equal(got, eager)
    assert c.get_seq_length() == eager_cache.get_seq_length() == 40
    assert torch.equal(c.layers[0].keys, eager_cache.layers[0].keys)
    assert lm.model.config._attn_implementation == resolve_attn(attn, "cpu")  # restored
    assert "update" not in vars(c)  # the patch is gone


def test_masked_attention_is_refused_before_touching_the_cache():
    lm = wrap_model(_model("eager", torch.float32, "cpu"), "fp32", "cpu")
    ids = torch.randint(1, 512, (2, 20))
    with torch.inference_mode():
        c = new_cache(lm.model)
        _forward(lm, ids[:, :10], c, 1)
        with pytest.raises(NoGraph, match="eager"):
            decode_chain(lm, ids, 10, c, mode="inline")
    assert c.get_seq_length() == 10


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("attn", ["sdpa", "sdpa_lower_right"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_histories_are_bitwise_the_eager_ones(attn, dtype):
    model = _model(attn, getattr(torch, dtype), "cuda", layers=4, hidden=256, head_dim=64)
    p, g = 120, 33
    ids = torch.randint(1, 512, (5, p + g), generator=torch.Generator().manual_seed(2)).cuda()
    hists = [s.resolve(p, g, 60) for s in parse_histories("full,prefix:60,chunked:50,decode,chunked:1")]
    before = STATS["graphed_chains"], STATS["graphed_steps"], len(STATS["fallbacks"])
    graphed = run_histories(wrap_model(model, "bf16", "cuda", cuda_graphs=True), ids[:, :-1], p - 1, hists)
    assert STATS["fallbacks"][before[2] :] == []
    # Two chains run as graphs, each after one eager step: decode's from the
    # first generated input (p .. p+g-2), chunked:1's from the last prompt
    # token, its first scored position (p-1 .. p+g-2).
    assert STATS["graphed_chains"] - before[0] == 2
    assert STATS["graphed_steps"] - before[1] == (g - 2) + (g - 1)
    eager = run_histories(wrap_model(model, "bf16", "cuda", cuda_graphs=False), ids[:, :-1], p - 1, hists)
    for h in hists:
        assert graphed[h.label].shape == (5, g, 512)
        assert torch.equal(graphed[h.label], eager[h.label]), h.label
    # and the history still differs from `full` only by rounding
    assert (graphed["decode"].float() - graphed["full"].float()).abs().max().item() < 0.1


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_graphed_chain_repeats_and_batches_of_one():
    model = _model("sdpa", torch.bfloat16, "cuda", layers=2, hidden=128, head_dim=32)
    lm = wrap_model(model, "bf16", "cuda")
    for n in (1, 7):
        ids = torch.randint(1, 512, (n, 64), generator=torch.Generator().manual_seed(n)).cuda()
        eager, _ = _eager_chain(lm, ids, 40)
        for _ in range(2):  # a second capture in the same process
            with torch.inference_mode():
                c = new_cache(model)
                _forward(lm, ids[:, :40], c, 1)
                got = decode_chain(lm, ids, 40, c)
            assert torch.equal(got, eager)
            assert c.get_seq_length() == 64


@pytest.mark.skipif(not CUDA, reason="cuDNN's one-token kernel is a CUDA matter")
def test_decode_is_reproducible_at_a_real_head_shape():
    """Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128)
    over 1,000 cached tokens: with sdpa_lower_right the eager decode chain is
    bitwise the same run after run (cuDNN's one-token kernel, which torch
    would pick, was not), and the graphed chain is bitwise the eager one."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = (
        AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation=resolve_attn("sdpa_lower_right", "cuda")
        )
        .cuda()
        .eval()
    )
    ids = torch.randint(1, 4096, (4, 1032), generator=torch.Generator().manual_seed(4)).cuda()
    decode = [parse_histories("decode")[0].resolve(1000, 32)]
    eager_lm, graph_lm = wrap_model(model, "bf16", "cuda", cuda_graphs=False), wrap_model(model, "bf16", "cuda")
    runs = [run_histories(lm, ids[:, :-1], 999, decode)["decode"] for lm in (eager_lm, eager_lm, graph_lm, graph_lm)]
    for r in runs[1:]:
        assert torch.equal(r, runs[0])


@pytest.mark.skipif(not CUDA, reason="the square path runs on CUDA only")
@pytest.mark.parametrize("q_len", [40, 64, 100])
def test_long_segment_on_a_cache_is_the_square_kernels_rows(q_len):
    """A segment of q >= kv/3 tokens on a cache runs as the square causal call
    over front-padded queries: lower-right aligned (against attention written
    out in FP64), and its rows are bitwise the rows of the square call over
    the real preceding queries (what `full` computes)."""
    import torch.nn.functional as F

    from tracekit.capture.teacher.attention import SQUARE_FROM, lower_right_sdpa

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    kv = 120
    assert SQUARE_FROM * q_len >= kv
    gen = torch.Generator(device="cuda").manual_seed(q_len)
    qf = torch.randn(2, 8, kv, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 4, kv, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    q = qf[:, :, kv - q_len :].contiguous()
    out, _ = lower_right_sdpa(Attn(), q, k, v, None, scaling=0.125)  # [2, q, 8, 64]
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    allowed = torch.arange(kv, device="cuda")[None, :] <= torch.arange(q_len, device="cuda")[:, None] + (kv - q_len)
    scores = (q.double() @ kk.transpose(-1, -2) * 0.125).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(scores, -1) @ vv).transpose(1, 2)
    assert (out.double() - ref).abs().max().item() < 2e-2  # BF16 rounding
    rows = F.scaled_dot_product_attention(qf, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(out, rows[:, :, kv - q_len :].transpose(1, 2))
