"""The GPU study's architectures through llama.cpp (issue 27): models.py's Qwen3 and Llama-3 configs
(`--smoke` shapes, random BF16 weights, the WordLevel `<tN>` tokenizer) converted to F32 GGUF by
scripts/convert_tiny_to_gguf.py, served by llama-server (f32 KV cache, flash attention off), match
HF transformers FP32 on the same weights.

What it pins: the vocabulary loads (a "gpt2" BPE vocabulary of `<tN>` NORMAL tokens, specials
CONTROL, one placeholder merge) and token-id prompts round-trip; Qwen3's q/k norms; Llama's q/k row
permutation and its "llama3" rope factors (`rope_freqs.weight`: without them the low-frequency
dimensions rotate 8x faster); the dtype is the engine's own (`/v1/models` meta.ftype 'all F32').
Measured on the 2-core CPU machine (llama.cpp 0c1e570, 4 prompts x 16 tokens): max
|logprob(engine) - logprob(HF FP32)| over every generated position's chosen token and its top-5 is
5.8e-5 nats (qwen3) / 3.0e-6 nats (llama); the bound is 2e-4. The same Llama GGUF with its rope
factors left at 1 (no llama3 scaling) is 9.0e-4 nats off, so the bound catches it (1e-3 would not).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support import load_file

from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.store import TraceReader

llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
models = load_file("bench/gpu_study/models.py", "gpu_study_models")
ROOT = llamacpp.ROOT
PROMPTS = ROOT / "fixtures" / "prompts" / "study_128.jsonl"
TOL_NATS = 2e-4  # measured 5.8e-5 / 3.0e-6; without the llama3 rope factors 9.0e-4 (module docstring)
N_PROMPTS, MAX_TOKENS = 4, 16


@pytest.fixture(scope="module", params=["qwen3-0.6b", "llama3-8b"])
def served(request, llama_bin, tmp_path_factory):
    """(name, model dir, trace of the served F32 GGUF's greedy outputs for N_PROMPTS prompts)."""
    name = request.param
    d = tmp_path_factory.mktemp(name)
    model_dir = models.save(models.build(name, "cpu", smoke=True), name, d, smoke=True)
    gguf = d / f"{name}-f32.gguf"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert_tiny_to_gguf.py"), str(model_dir), str(gguf)],
        check=True,
        capture_output=True,
    )
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:N_PROMPTS]))
    out = d / "serial.h5"
    with llamacpp.start_server(llama_bin, gguf, slots=1, ctx=1024, log_path=str(d / "llama-server.log")) as eng:
        opts = dict(max_tokens=MAX_TOKENS, ignore_eos=True, top_logprobs=5, progress=False, cache_prompt=False)
        opts |= dict(tokenizer=str(model_dir), prompts=str(prompts), out=str(out))
        s = run_capture(CaptureConfig(url=eng.url, **opts))
    assert s.failed == 0 and s.unknown_id_tokens == 0, s
    return name, model_dir, out


def _hf_logprobs(model_dir, prompt: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """[len(generated), V] FP32 log-softmax of HF transformers at each generated position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.concatenate([prompt, generated])[None].astype(np.int64))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(generated)], dim=-1).numpy()


def test_engine_logprobs_match_hf_fp32_and_dtype_is_the_engines(served):
    name, model_dir, trace = served
    worst, compared = 0.0, 0
    with TraceReader(trace) as r:
        assert (r.meta.run["dtype"], r.meta.run["dtype_source"]) == ("fp32", "engine: /v1/models meta.ftype 'all F32'")
        assert len(r) == N_PROMPTS
        for i in range(len(r)):
            t, prompt = r.tokens(i), r.prompt_ids(i)
            assert prompt is not None and len(prompt) == 128 and len(t.token_id) == MAX_TOKENS
            ref = _hf_logprobs(model_dir, prompt, t.token_id)
            rows = np.arange(MAX_TOKENS)
            # the engine's greedy token is HF's argmax wherever HF's top two are not a near-tie
            top2 = np.sort(ref, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-3
            assert (ref.argmax(-1) == t.token_id)[clear].all(), (name, i)
            worst = max(worst, float(np.abs(t.logprob - ref[rows, t.token_id]).max()))
            ok = t.topk_id >= 0
            assert ok.sum(axis=1).min() == 5, t.topk_id
            k_ref = np.take_along_axis(ref, np.where(ok, t.topk_id, 0), axis=1)
            worst = max(worst, float(np.abs(np.where(ok, t.topk_logprob - k_ref, 0)).max()))
            compared += MAX_TOKENS
    print(json.dumps({"model": name, "positions": compared, "max_abs_dlogprob_nats": worst}))
    assert compared == N_PROMPTS * MAX_TOKENS
    assert worst < TOL_NATS, (name, worst)
