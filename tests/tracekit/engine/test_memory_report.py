"""The engine's memory self-report and kernel choice (tracekit/engine/memory.py, kernels.py)."""

from __future__ import annotations

import json
import urllib.request

import torch

from tracekit.engine.executor import ModelExecutor, default_model_dir
from tracekit.engine.kernels import step_kernels
from tracekit.engine.memory import fits_lanes, kv_bytes_per_slot, memory_report
from tracekit.engine.process import start_engine


def test_kv_bytes_per_slot_is_one_slot_of_the_buffer():
    """The prediction from the config equals the bytes the executor really allocates per slot,
    in both dtypes: a reader can trust the formula for devices it has not run on."""
    for dtype, elt in (("fp32", 4), ("bf16", 2)):
        ex = ModelExecutor(default_model_dir(), dtype=dtype, slots=3, max_context=256)
        rep = memory_report(ex)
        assert rep["kv_bytes_per_slot"] == kv_bytes_per_slot(4, 2, 32, 256, elt) == 4 * 2 * 32 * 2 * 256 * elt
        assert rep["kv_bytes_allocated"] == 3 * rep["kv_bytes_per_slot"]
        n_params = sum(p.numel() for p in ex.model.parameters())
        assert rep["weights_bytes"] == n_params * elt
        assert rep["device_peak_bytes"] is None  # CPU: unknown, never 0


def test_fits_lanes():
    """The user's case: 1.21 GB of BF16 KV per lane (Llama-3 8B shape, context 9,216); five lanes
    and 10.9 GB of weights-and-overhead do not fit 16.9 GB, four do."""
    per_lane = kv_bytes_per_slot(32, 8, 128, 9216, 2)
    assert per_lane == 1_207_959_552
    assert fits_lanes(10_900_000_000, per_lane, 4, 16_900_000_000)["fits"]
    assert not fits_lanes(10_900_000_000, per_lane, 5, 16_900_000_000)["fits"]


def test_step_kernels_only_restrict_cuda_one_token_steps():
    """CPU forwards and multi-token (prefill) forwards run with torch's own choice."""
    import contextlib

    assert isinstance(step_kernels(torch.device("cpu"), 1), contextlib.nullcontext)
    assert isinstance(step_kernels(torch.device("cuda"), 7), contextlib.nullcontext)
    assert isinstance(step_kernels(torch.device("cuda"), 1, allow_cudnn=True), contextlib.nullcontext)
    assert not isinstance(step_kernels(torch.device("cuda"), 1), contextlib.nullcontext)


def test_self_report_states_memory(tmp_path):
    """/v1/models meta carries the KV prediction and the kernel choice of a real engine."""
    with start_engine(["--slots", "2", "--max-context", "128"], log_path=tmp_path / "e.log") as eng:
        with urllib.request.urlopen(eng.url + "/v1/models", timeout=30) as r:
            meta = json.loads(r.read())["data"][0]["meta"]
    assert meta["kv_bytes_per_slot"] == 4 * 2 * 32 * 2 * 128 * 4
    assert meta["kv_bytes_allocated"] == 2 * meta["kv_bytes_per_slot"]
    assert meta["attn_kernels"]["decode"] == "torch default"
    assert meta["device_peak_bytes"] is None
