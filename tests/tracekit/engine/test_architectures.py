"""Other HF architectures serve too: tiny random Llama and Gemma3 (sliding-window layers), and every
engine output agrees with transformers' own greedy `generate` in FP32."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.engine_helpers import fixture_prompts, greedy, run_concurrent, run_serial

TINY = Path(__file__).resolve().parents[3] / "fixtures" / "models" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_random(kind: str, out: Path) -> Path:
    """A random-weight model of the given family, sharing the fixture tokenizer (2,048 ids)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:  # one sliding layer (window 24) then a global one: prompts here are longer than the window
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(**common, sliding_window=24, layer_types=["sliding_attention", "full_attention"])
        )
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, out / name)
    return out


def _hf_greedy(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=1
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3-fixture", "llama", "gemma3"])
def test_architecture_serves_and_matches_hf_generate(engine_factory, tmp_path_factory, kind):
    """The engine must be a faithful runner of the HF model: FP32 greedy output equals transformers'
    `generate`, and 8 concurrent requests equal the serial ones, for each family."""
    if kind == "qwen3-fixture":
        model_dir, eng = TINY, engine_factory()
    else:
        model_dir = _save_random(kind, tmp_path_factory.mktemp(kind))
        eng = engine_factory("--model", str(model_dir))
    bodies = [greedy(p["prompt"], 12) for p in fixture_prompts()[:8]]
    serial = run_serial(eng.url, bodies)
    conc = run_concurrent(eng.url, bodies, concurrency=8)
    ids = [r["choices"][0]["token_ids"] for r in serial]
    assert [r["choices"][0]["token_ids"] for r in conc] == ids
    p = serial[1]["choices"][0]["prompt_token_ids"]
    assert len(p) > 24  # longer than the Gemma3 sliding window
    assert ids[1] == _hf_greedy(model_dir, p, 12)
