"""A random-weight Llama or Gemma3 of the tiny fixture's size (vocabulary and tokenizer shared
with fixtures/models/tiny), saved as safetensors: the engine's architecture tests build on it."""

from __future__ import annotations

import shutil
from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny"


def save_random_model(kind: str, out: Path) -> Path:
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
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, out / name)
    return out
