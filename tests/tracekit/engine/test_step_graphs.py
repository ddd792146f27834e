"""The decode step as graphs with holes (tracekit/engine/stepgraph.py) computes bitwise what the eager
step computes. On CPU, mode "inline" runs the recorded path (hole attention, deferred masks resolved
from the first step's recorded calls with each step's cache and mask swapped in) without graphs; on
CUDA, mode "graphs" replays the captured graphs. Both are compared with the eager executor step by
step over one script: padded batches, a batch size changing, a slot refilled (a new batch buffer on a
recorded batch size), batch-buffer rebuilds, single rows, and (Gemma3) sliding-window layers whose
mask appears once the keys outgrow the window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.random_models import save_random_model

TINY = Path(__file__).resolve().parents[3] / "fixtures" / "models" / "tiny"
PROMPTS = Path(__file__).resolve().parents[3] / "fixtures" / "prompts" / "tiny.jsonl"


def _prompts() -> list[list[int]]:
    rows = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()]
    ids = [t for r in rows for t in (r if isinstance(r, list) else [])]
    if not ids:  # text prompts: the fixture tokenizer's ids
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(TINY)
        ids = [t for r in rows for t in tok(r)["input_ids"]]
    return [ids[i : i + n] for i, n in zip((0, 40, 80, 120, 160), (5, 13, 9, 30, 11))]


def run_script(ex, prompts: list[list[int]]) -> tuple[list, list[str]]:
    """Prefill, then decode steps over changing batches; every step's logits (CPU copies) and its label."""
    import torch

    out, labels = [], []
    state = {}  # slot -> [length, next id]

    def fill(slot, p):
        logits = ex.prefill(slot, p, 0)
        out.append(logits.float().cpu())
        labels.append(f"prefill slot {slot}")
        state[slot] = [len(p), int(logits.float().argmax(-1))]

    def steps(slots, n, label):
        for k in range(n):
            logits = ex.decode(slots, [state[s][0] for s in slots], [state[s][1] for s in slots])
            out.append(logits.float().cpu())
            labels.append(f"{label} step {k}")
            for i, s in enumerate(slots):
                state[s][0] += 1
                state[s][1] = int(torch.argmax(logits[i].float()))

    for s in range(4):
        fill(s, prompts[s])
    steps([0, 1, 2, 3], 6, "B4 padded")
    steps([0, 1, 3], 4, "B3")  # a new batch size
    fill(2, prompts[4])  # a refilled slot: a new batch buffer, batch size 4 already recorded
    steps([0, 1, 2, 3], 70, "B4 again (crosses the 64-column headroom: rebuild)")
    steps([1], 3, "B1")
    steps([0, 1], 3, "B2 equal lengths? no: padded")
    return out, labels


def _executors(model: Path, dtype: str, mode: str, device: str = "cpu"):
    from tracekit.engine.executor import ModelExecutor

    eager = ModelExecutor(model, dtype, "sdpa", device, slots=4, max_context=256, decode_graphs="eager")
    other = ModelExecutor(model, dtype, "sdpa", device, slots=4, max_context=256, decode_graphs=mode)
    return eager, other


def _assert_bitwise(model: Path, dtype: str, mode: str, device: str = "cpu"):
    import torch

    eager, other = _executors(model, dtype, mode, device)
    prompts = _prompts()
    a, labels = run_script(eager, prompts)
    b, _ = run_script(other, prompts)
    bad = [lab for x, y, lab in zip(a, b, labels) if not torch.equal(x, y)]
    assert not bad, f"{len(bad)} of {len(a)} steps differ, first: {bad[0]}"
    rep = other.graph_report()
    # the recorded path really ran, for every batch size of the script
    assert rep["mode"] == mode and rep["batch_sizes"] == [1, 2, 3, 4], rep
    assert rep["eager_batch_sizes"] == []
    steps = {k: sg.steps for k, sg in other._graphs.items()}
    assert steps[4] == 6 - 1 + 70 and steps[3] == 4 - 1 and steps[1] == 3 - 1 and steps[2] == 3 - 1, steps
    return a


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_inline_path_bitwise_tiny_qwen3(dtype):
    logits = _assert_bitwise(TINY, dtype, "inline")
    assert len(logits) == 5 + 6 + 4 + 70 + 3 + 3
    # the script's batches really were padded (rows of unequal lengths): BF16 logits of a padded
    # batch differ from the same rows served alone somewhere, or the comparison would test little
    assert all(torch_finite(x) for x in logits)


def torch_finite(x) -> bool:
    import torch

    return bool(torch.isfinite(x).all())


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_inline_path_bitwise_other_architectures(kind, tmp_path):
    model = save_random_model(kind, tmp_path / kind)
    _assert_bitwise(model, "bf16", "inline")


def test_inline_masks_come_from_the_recorded_calls(tmp_path):
    """Gemma3's sliding layer gets no mask while the keys fit the window and no row is padded, and a
    mask once they outgrow it: the deferred masks must follow that per step, not the first step's."""
    import torch

    from tracekit.engine.executor import ModelExecutor

    model = save_random_model("gemma3", tmp_path / "g")
    ex = ModelExecutor(model, "fp32", "sdpa", "cpu", slots=2, max_context=128, decode_graphs="inline")
    p = _prompts()[0]  # 5 tokens: the window (24) is crossed after 19 steps
    nxt = int(ex.prefill(0, p, 0).argmax(-1))
    seen = []
    for k in range(30):
        logits = ex.decode([0], [len(p) + k], [nxt])
        nxt = int(torch.argmax(logits[0]))
        sg = ex._graphs.get(1)
        if sg and sg.steps:  # the first step of the batch size is the eager one that records
            seen.append(tuple(m is None for m in sg.masks))
    assert len(seen) == 29
    # (full, sliding) or (sliding, full) order as the model calls them: all None early, one non-None late
    assert seen[0] == (True, True)
    assert seen[-1].count(False) == 1


def test_bad_mode_is_an_engine_error():
    from tracekit.engine.executor import ModelExecutor
    from tracekit.errors import EngineError

    with pytest.raises(EngineError, match="decode_graphs"):
        ModelExecutor(TINY, "fp32", "sdpa", "cpu", slots=1, decode_graphs="fast")
    with pytest.raises(EngineError, match="CUDA"):
        ModelExecutor(TINY, "fp32", "sdpa", "cpu", slots=1, decode_graphs="graphs")


def test_cpu_default_is_eager():
    from tracekit.engine.executor import ModelExecutor

    ex = ModelExecutor(TINY, "fp32", "sdpa", "cpu", slots=1)
    assert ex.decode_graphs == "eager"


cuda = pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_graphs_bitwise_tiny_qwen3(dtype):
    _assert_bitwise(TINY, dtype, "graphs", "cuda")


@cuda
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cuda_graphs_bitwise_other_architectures(kind, tmp_path):
    _assert_bitwise(save_random_model(kind, tmp_path / kind), "bf16", "graphs", "cuda")
