#!/usr/bin/env python3
"""Convert a small Hugging Face Qwen3 checkpoint with a byte-level BPE tokenizer (the fixture model
fixtures/models/tiny) to a GGUF file that llama.cpp's `llama-server` loads.

    python scripts/convert_tiny_to_gguf.py fixtures/models/tiny OUT.gguf [--outtype f32|bf16]

Written with the `gguf` package (PyPI, the dev extra), not llama.cpp's `convert_hf_to_gguf.py`: that
converter identifies a BPE pre-tokenizer by the hash of its vocabulary and refuses unknown ones (the
tiny model's 2,048-entry vocabulary is unknown to it), and it routes Qwen vocabularies through a
SentencePiece path first. What this script writes is what that converter writes for a Qwen3 whose
pre-tokenizer is GPT-2's byte-level regex (`tokenizer.ggml.pre = "gpt-2"`): the same hyperparameter
keys, tensor names from gguf's own name map, 2-D weights in the asked type and 1-D norms in f32 (as
the converter keeps them), no `output.weight` when the embeddings are tied (llama.cpp then reuses
`token_embd`), and the tokenizer's special tokens as CONTROL.

It does not convert other architectures, SentencePiece tokenizers, or quantize.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _fail(msg: str) -> None:
    print(f"Error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        _fail(f"{model_dir}: no *.safetensors weights")
    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except (TypeError, ValueError):  # bf16 weights: numpy has no bfloat16, go through torch
            from safetensors.torch import load_file as load_torch

            out.update({k: v.float().numpy() for k, v in load_torch(f).items()})
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def _vocab(model_dir: Path) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens by id, token types, merges "a b", tokenizer_config) of a byte-level BPE tokenizer.json."""
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        _fail(f"{model_dir}/tokenizer.json: only byte-level BPE with GPT-2's regex converts (got {model.get('type')})")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {}
    for a in tok.get("added_tokens") or ():
        vocab[a["content"]] = a["id"]
        if a.get("special"):
            special[a["id"]] = a["content"]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(gguf.TokenType.UNUSED)] * n
    for s, i in vocab.items():
        tokens[i] = s
        types[i] = int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return tokens, types, merges, cfg


def convert(model_dir: Path, out: Path, outtype: str) -> None:
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        _fail(f"{model_dir}: model_type {cfg.get('model_type')!r}; this script converts qwen3 only")
    n_layer = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        _fail(f"{model_dir}: rope scaling is not supported here")
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16}[outtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3])
    w.add_name(model_dir.name)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(n_layer)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(ftype)

    tokens, types, merges, tcfg = _vocab(model_dir)
    if len(tokens) > int(cfg["vocab_size"]):
        _fail(f"{model_dir}: tokenizer has {len(tokens)} tokens, config vocab_size {cfg['vocab_size']}")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), int(cfg["vocab_size"]))]
    types += [int(gguf.TokenType.UNUSED)] * (len(tokens) - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = {s: i for i, s in enumerate(tokens)}
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        if tcfg.get(key) in ids:
            add(ids[tcfg[key]])
    if tcfg.get("pad_token") in ids:
        w.add_pad_token_id(ids[tcfg["pad_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n_layer)
    weights = _load_weights(model_dir)
    tied = bool(cfg.get("tie_word_embeddings"))
    for name, t in sorted(weights.items()):
        base, _, suffix = name.rpartition(".")
        if tied and base == "lm_head":
            continue  # llama.cpp reuses token_embd when output.weight is absent
        new = names.get_name(base)
        if new is None:
            _fail(f"{model_dir}: no GGUF name for tensor {name!r}")
        if t.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{new}.{suffix}", gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{new}.{suffix}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", choices=("f32", "bf16"), default="f32")
    a = ap.parse_args(argv)
    if not (a.model_dir / "config.json").exists():
        _fail(f"{a.model_dir}: not a model directory (no config.json)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        _fail("the `gguf` package is missing: pip install -e '.[dev]' (or pip install gguf)")
    tmp = a.out.with_name(a.out.name + ".tmp")
    convert(a.model_dir, tmp, a.outtype)
    tmp.replace(a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
