"""Fused QKV and gate/up GEMMs (tracekit/engine/fuse.py): used only where the load-time check finds
them bitwise, and then the engine's logits are bitwise the unfused engine's over the step-graph
script (padded batches, batch sizes changing, refills, rebuilds), in the eager and the recorded
(inline) decode paths, for Qwen3, Llama and Gemma3. A prefill longer than the slots runs the
separate GEMMs; a projection called on another tensor falls back to its own GEMM."""

from __future__ import annotations

import pytest
import torch
from support.random_models import save_random_model
from test_step_graphs import TINY, _prompts, run_script


def _executor(model, dtype, fused, mode="eager"):
    from tracekit.engine.executor import ModelExecutor

    return ModelExecutor(
        model, dtype, "sdpa", "cpu", slots=4, max_context=256, decode_graphs=mode, fuse_projections=fused
    )


def _assert_fused_is_bitwise(model, dtype, mode, expect_all=True):
    plain, fused = _executor(model, dtype, False), _executor(model, dtype, True, mode)
    rep = fused.graph_report()["fused_projections"]
    layers = fused.n_layers
    assert rep["groups_fused"] + rep["groups_left"] == 2 * layers and rep["max_rows"] == 4, rep
    if expect_all:
        # in BF16 this machine's BLAS reduces K alike for the fused and the separate shapes
        assert rep["enabled"] and rep["groups_fused"] == 2 * layers, rep
        assert all(s["bitwise"] for s in rep["shapes"])
    if not rep["enabled"]:
        return dict(rep, layers=layers)
    assert plain.graph_report()["fused_projections"] == {"groups_fused": 0, "enabled": False}
    groups = fused.fusion["_groups"]
    calls0 = sum(g.fused_calls for g in groups)
    prompts = _prompts()
    a, labels = run_script(plain, prompts)
    b, _ = run_script(fused, prompts)
    bad = [lab for x, y, lab in zip(a, b, labels) if not torch.equal(x, y)]
    assert not bad, f"{len(bad)} of {len(a)} steps differ, first: {bad[0]}"
    # the fused GEMMs really ran: once per group per decode step (and per prefill of <= 4 tokens: none here)
    decode_steps = len(a) - 5
    assert sum(g.fused_calls for g in groups) - calls0 == decode_steps * 2 * layers
    assert all(g.last is None for g in groups)  # every call's parts served, no tensor kept
    return dict(rep, layers=layers)


@pytest.mark.parametrize("mode", ["eager", "inline"])
def test_fused_engine_is_bitwise_the_unfused_one_qwen3(mode):
    _assert_fused_is_bitwise(TINY, "bf16", mode)


def test_fp32_fuses_only_the_shapes_the_check_finds_bitwise():
    """CPU FP32 GEMMs of M <= 4 do not all reduce K alike at the fused and the separate widths (on
    this machine none of the tiny model's shapes passes): the check decides, and whatever it
    fused, the logits are the unfused engine's bitwise."""
    rep = _assert_fused_is_bitwise(TINY, "fp32", "eager", expect_all=False)
    # two shapes (QKV, gate/up), each in every layer: a shape fuses in all its layers or in none
    assert len(rep["shapes"]) == 2
    assert rep["groups_fused"] == rep["layers"] * sum(s["bitwise"] for s in rep["shapes"])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_fused_engine_is_bitwise_other_architectures(kind, tmp_path):
    _assert_fused_is_bitwise(save_random_model(kind, tmp_path / kind), "bf16", "eager")


def test_long_inputs_and_other_tensors_take_the_separate_gemms():
    import torch.nn.functional as F

    ex = _executor(TINY, "bf16", True)
    group = ex.fusion["_groups"][0]
    attn = next(m for m in ex.model.modules() if hasattr(m, "q_proj"))
    k = attn.q_proj.weight.shape[1]
    long = torch.randn(1, 9, k, dtype=torch.bfloat16)  # 9 rows > 4 slots: a prefill
    before = group.fused_calls
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert torch.equal(lin(long), F.linear(long, lin.weight))
    assert group.fused_calls == before
    x, y = torch.randn(2, 1, k, dtype=torch.bfloat16), torch.randn(2, 1, k, dtype=torch.bfloat16)
    q = attn.q_proj(x)  # fused, on x
    kx = attn.k_proj(y)  # another tensor: its own fused call, its own columns
    assert group.fused_calls == before + 2
    assert torch.equal(q, F.linear(x, attn.q_proj.weight)) and torch.equal(kx, F.linear(y, attn.k_proj.weight))
    # the weights are views of the fused weight's rows: no second copy of them
    assert attn.k_proj.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()


def test_a_shape_that_is_not_bitwise_is_left_alone(monkeypatch):
    from tracekit.engine import fuse

    monkeypatch.setattr(fuse, "_bitwise", lambda parts, max_rows, seed=0: len(parts) == 2)  # QKV "not bitwise"
    ex = _executor(TINY, "fp32", True)
    rep = ex.graph_report()["fused_projections"]
    assert rep["groups_fused"] == ex.n_layers and rep["groups_left"] == ex.n_layers
    assert sorted(s["bitwise"] for s in rep["shapes"]) == [False, True]
    attn = next(m for m in ex.model.modules() if hasattr(m, "q_proj"))
    assert "forward" not in vars(attn.q_proj)  # QKV untouched
