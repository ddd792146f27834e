#!/usr/bin/env python3
"""Convert a Hugging Face Qwen3 or Llama checkpoint (the fixture model fixtures/models/tiny, or a
random-weight study model of bench/gpu_study/models.py) to a GGUF file that llama.cpp's
`llama-server` loads.

    python scripts/convert_tiny_to_gguf.py MODEL_DIR OUT.gguf [--outtype f32|bf16]

Written with the `gguf` package (PyPI, the dev extra; or llama.cpp's own `gguf-py` directory on
PYTHONPATH, as on the GPU image, which has no `gguf`), not llama.cpp's `convert_hf_to_gguf.py`: that
converter identifies a BPE pre-tokenizer by the hash of its vocabulary and refuses unknown ones (the
tiny model's 2,048-entry vocabulary is unknown to it), and it routes Qwen vocabularies through a
SentencePiece path first. What this script writes is what that converter writes for the same model
with GPT-2's byte-level pre-tokenizer (`tokenizer.ggml.pre = "gpt-2"`): the same hyperparameter
keys, tensor names from gguf's own name map, 2-D weights in the asked type and 1-D norms in f32 (as
the converter keeps them), no `output.weight` when the embeddings are tied (llama.cpp then reuses
`token_embd`), the tokenizer's special tokens as CONTROL. For Llama also what its LlamaModel does:
q/k rows permuted to llama.cpp's rope layout, `llama.rope.dimension_count`, and a `rope_freqs`
tensor of the "llama3" rope scaling's per-dimension factors.

Tokenizers: byte-level BPE (the fixture's), or the study models' WordLevel vocabulary (`<t123>` per
id), written as a "gpt2" vocabulary whose tokens are those strings (NORMAL) with one merge: llama.cpp
requires the merges key, and prompts go in as token ids, so the vocabulary only has to load and
detokenize. Tensors are streamed one at a time from the safetensors files (a 4B model's F32 GGUF is
16 GB; no full copy is held). It does not convert other architectures, SentencePiece, or quantize.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import numpy as np

ARCHS = {"qwen3": "QWEN3", "llama": "LLAMA"}
# A WordLevel vocabulary has no merges; llama.cpp's BPE loader needs the key, any pair will do.
PLACEHOLDER_MERGES = ["< t"]


def _fail(msg: str) -> None:
    print(f"Error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def import_gguf():
    """`gguf`, from site-packages or a llama.cpp `gguf-py` directory on PYTHONPATH. Its metadata
    module imports yaml only for model cards (unused here): a stub stands in where yaml is absent."""
    try:
        import yaml  # noqa: F401
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    try:
        import gguf
    except ImportError:
        _fail(
            "the `gguf` package is missing: pip install -e '.[dev]' (or pip install gguf), or put "
            "llama.cpp's gguf-py directory on PYTHONPATH"
        )
    return gguf


def _vocab(model_dir: Path, gguf) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens by id, token types, merges "a b", tokenizer_config) of a byte-level BPE or a WordLevel
    tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if model.get("type") == "WordLevel":
        merges = PLACEHOLDER_MERGES
    elif model.get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]
    else:
        _fail(
            f"{model_dir}/tokenizer.json: only byte-level BPE with GPT-2's regex or WordLevel converts "
            f"(got {model.get('type')})"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = {}
    for a in tok.get("added_tokens") or ():
        vocab[a["content"]] = a["id"]
        if a.get("special"):
            special[a["id"]] = a["content"]
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if isinstance(cfg.get(key), str) and cfg[key] in vocab:
            special[vocab[cfg[key]]] = cfg[key]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types_ = [int(gguf.TokenType.UNUSED)] * n
    for s, i in vocab.items():
        tokens[i] = s
        types_[i] = int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    return tokens, types_, merges, cfg


def _rope(cfg: dict) -> dict:
    """The rope parameters of either transformers layout (`rope_parameters` or `rope_scaling`)."""
    rope = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: the frequency divisors of the
    "llama3" rope scaling, one per rotated pair (llama.cpp reads them as `rope_freqs.weight`)."""
    base = float(rope["rope_theta"])
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def permute(w, n_head: int):
    """LlamaModel.permute: HF's rotate-half q/k rows to llama.cpp's interleaved rope pairs
    (a torch tensor or a numpy array; an exact reordering, any dtype)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Source:
    """The checkpoint's tensors by name, read one at a time (safetensors, any dtype, via torch)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            _fail(f"{model_dir}: no *.safetensors weights")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def get(self, name: str):
        return self.where[name].get_tensor(name)  # a torch tensor in the file's dtype


def _hparams(w, cfg: dict, arch: str, gguf, ftype) -> None:
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(_rope(cfg)["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(int(cfg["vocab_size"]))
        w.add_rope_dimension_count(head_dim)


def _tokenizer(w, model_dir: Path, cfg: dict, gguf) -> None:
    tokens, types_, merges, tcfg = _vocab(model_dir, gguf)
    if len(tokens) > int(cfg["vocab_size"]):
        _fail(f"{model_dir}: tokenizer has {len(tokens)} tokens, config vocab_size {cfg['vocab_size']}")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), int(cfg["vocab_size"]))]
    types_ += [int(gguf.TokenType.UNUSED)] * (len(tokens) - len(types_))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types_)
    w.add_token_merges(merges)
    ids = {s: i for i, s in enumerate(tokens)}
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        if tcfg.get(key) in ids:
            add(ids[tcfg[key]])
    if tcfg.get("pad_token") in ids:
        w.add_pad_token_id(ids[tcfg["pad_token"]])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))


def convert(model_dir: Path, out: Path, outtype: str) -> None:
    gguf = import_gguf()
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        _fail(f"{model_dir}: model_type {arch!r}; this script converts {', '.join(ARCHS)} only")
    rope = _rope(cfg)
    if rope["rope_type"] not in ("default", "llama3") or (rope["rope_type"] == "llama3" and arch != "llama"):
        _fail(f"{model_dir}: rope type {rope['rope_type']!r} is not supported here (default; llama3 for llama)")
    n_layer, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    march = getattr(gguf.MODEL_ARCH, ARCHS[arch])
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16}[outtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[march])
    w.add_name(model_dir.name)
    _hparams(w, cfg, arch, gguf, ftype)
    _tokenizer(w, model_dir, cfg, gguf)

    names = gguf.get_tensor_name_map(march, n_layer)
    src = _Source(model_dir)
    tied = bool(cfg.get("tie_word_embeddings"))
    plan = []  # (gguf name, hf name or None for rope_freqs, shape, stored as F32)
    if rope["rope_type"] == "llama3":
        rope_freqs = llama3_rope_factors(rope, head_dim)
        plan.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None, [head_dim // 2], True))
    for name in sorted(src.where):
        base, _, suffix = name.rpartition(".")
        if tied and base == "lm_head":
            continue  # llama.cpp reuses token_embd when output.weight is absent
        new = names.get_name(base)
        if new is None:
            _fail(f"{model_dir}: no GGUF name for tensor {name!r}")
        shape = src.shape(name)
        plan.append((f"{new}.{suffix}", name, shape, len(shape) < 2 or qtype == gguf.GGMLQuantizationType.F32))
    plan.sort(key=lambda p: p[1] or "")  # the HF names' order (rope_freqs first), as before streaming
    for new, _, shape, f32 in plan:
        n = math.prod(shape)
        if f32:
            w.add_tensor_info(new, shape, np.dtype(np.float32), n * 4)
        else:  # raw BF16: the logical shape, 2 bytes an element
            w.add_tensor_info(new, shape, np.dtype(np.float32), n * 2, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for new, name, shape, f32 in plan:
        w.write_tensor_data(_tensor(src, name, f32, arch, n_head, n_kv, gguf, qtype) if name else rope_freqs)
    w.close()


def _tensor(src: _Source, name: str, f32: bool, arch: str, n_head: int, n_kv: int, gguf, qtype) -> np.ndarray:
    """One tensor as the bytes the GGUF stores: F32, or BF16 bits (a BF16 source's own bits, else
    gguf's round-to-nearest-even of the F32 values)."""
    import torch

    t = src.get(name)
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        t = permute(t, n_head if "q_proj" in name else n_kv)
    if f32:
        return np.ascontiguousarray(t.to(torch.float32).numpy())
    if t.dtype == torch.bfloat16:
        return np.ascontiguousarray(t.contiguous().view(torch.int16).numpy().view(np.uint16))
    return gguf.quants.quantize(t.to(torch.float32).numpy(), qtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", choices=("f32", "bf16"), default="f32")
    a = ap.parse_args(argv)
    if not (a.model_dir / "config.json").exists():
        _fail(f"{a.model_dir}: not a model directory (no config.json)")
    import_gguf()
    tmp = a.out.with_name(a.out.name + ".tmp")
    convert(a.model_dir, tmp, a.outtype)
    tmp.replace(a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
