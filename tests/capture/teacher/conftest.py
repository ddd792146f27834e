"""Fixtures for the teacher-forced diagnostic tests: a tiny random Qwen3 on disk.

The trained fixture model (fixtures/models/tiny) is used where trained
numerics matter (argmax flips); the random one keeps the unit tests
independent of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FIXTURE_MODEL = REPO / "fixtures" / "models" / "tiny"


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    import torch

    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Qwen3 (vocab 512, EOS id 0) saved with save_pretrained."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # Qwen3 defaults to 128
        max_position_embeddings=1024,
        eos_token_id=0,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tinyrand")
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def fixture_model_dir() -> Path:
    if not (FIXTURE_MODEL / "config.json").exists():
        pytest.skip("fixtures/models/tiny is not built yet (python fixtures/build_tiny_model.py)")
    return FIXTURE_MODEL
