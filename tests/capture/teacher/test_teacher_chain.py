"""CPU decode chains over a preallocated KV cache (capture/teacher/chain.py).

The chain must give bitwise the logits (and leave bitwise the cache) of eager
single-token steps on transformers' DynamicCache, which grows by torch.cat a
step; and run_histories must actually take it for `decode` on CPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tracekit.capture.teacher import chain  # noqa: E402
from tracekit.capture.teacher.history import parse_histories  # noqa: E402
from tracekit.capture.teacher.model import fork_cache, resolve_attn, wrap_model  # noqa: E402
from tracekit.capture.teacher.trie import _forward, run_histories  # noqa: E402
from tracekit.hfcompat import new_dynamic_cache as new_cache  # noqa: E402


def _lm(attn: str, dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=resolve_attn(attn, "cpu"))
    return wrap_model(m.eval(), "fp32", "cpu")


def _prefilled(lm, ids, start):
    c = new_cache(lm.model)
    _forward(lm, ids[:, :start], c, 1)
    return c


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_lower_right"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_preallocated_chain_is_the_eager_chain_bitwise(attn, dtype):
    lm = _lm(attn, getattr(torch, dtype))
    ids = torch.randint(1, 512, (3, 70), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref_cache = _prefilled(lm, ids, 41)
        eager = torch.cat([_forward(lm, ids[:, p : p + 1], ref_cache, 1) for p in range(41, 70)], 1)
        c = _prefilled(lm, ids, 41)
        sibling = fork_cache(c)  # shares c's prefix tensors, as a trie fork does
        before = sibling.layers[0].keys.clone()
        assert chain.applies(lm, c)
        got = chain.preallocated_chain(lm, ids, 41, c, _forward)
    assert got.shape == (3, 29, 512) and got.dtype == getattr(torch, dtype)
    assert torch.equal(got, eager)
    assert c.get_seq_length() == ref_cache.get_seq_length() == 70
    for mine, ref in zip(c.layers, ref_cache.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    assert torch.equal(sibling.layers[0].keys, before) and sibling.get_seq_length() == 41  # untouched


def test_decode_history_takes_the_preallocated_chain_and_keeps_its_numbers():
    """run_histories' `decode` on CPU goes through the chain, and every history is bitwise what
    it was with eager DynamicCache steps (the chain turned off for the reference)."""
    lm = _lm("sdpa", torch.bfloat16)
    ids = torch.randint(1, 512, (2, 48), generator=torch.Generator().manual_seed(3))
    p, g = 30, 18
    hists = [s.resolve(p, g) for s in parse_histories("full,prefix:11,chunked:9,decode")]
    n0 = chain.STATS["preallocated_chains"]
    got = run_histories(lm, ids[:, :-1], p - 1, hists)
    assert chain.STATS["preallocated_chains"] == n0 + 1
    real = chain.applies
    try:
        chain.applies = lambda lm, cache: False  # the eager steps, as before the chain existed
        ref = run_histories(lm, ids[:, :-1], p - 1, hists)
    finally:
        chain.applies = real
    assert chain.STATS["preallocated_chains"] == n0 + 1
    for h in hists:
        assert torch.equal(got[h.label], ref[h.label]), h.label


def test_a_cache_it_cannot_hold_runs_the_steps_eagerly():
    lm = _lm("sdpa", torch.float32)
    assert not chain.applies(lm, new_cache(lm.model))  # not filled yet: nothing to preallocate from
    cuda_lm = wrap_model(lm.model, "fp32", "cuda")
    ids = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        c = _prefilled(lm, ids, 8)
    assert chain.applies(lm, c) and not chain.applies(cuda_lm, c)  # CUDA: graphs.py or eager steps
