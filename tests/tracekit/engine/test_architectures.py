"""Other HF architectures serve too: tiny random Llama and Gemma3 (sliding-window layers), and every
engine output agrees with transformers' own greedy `generate` in FP32."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_helpers import fixture_prompts, greedy, run_concurrent, run_serial
from support.random_models import save_random_model

TINY = Path(__file__).resolve().parents[3] / "fixtures" / "models" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
        model_dir = save_random_model(kind, tmp_path_factory.mktemp(kind))
        eng = engine_factory("--model", str(model_dir))
    bodies = [greedy(p["prompt"], 12) for p in fixture_prompts()[:8]]
    serial = run_serial(eng.url, bodies)
    conc = run_concurrent(eng.url, bodies, concurrency=8)
    ids = [r["choices"][0]["token_ids"] for r in serial]
    assert [r["choices"][0]["token_ids"] for r in conc] == ids
    p = serial[1]["choices"][0]["prompt_token_ids"]
    assert len(p) > 24  # longer than the Gemma3 sliding window
    assert ids[1] == _hf_greedy(model_dir, p, 12)
