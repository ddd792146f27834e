"""The model runner: one HF causal LM, per-slot KV buffers, prefill and batched decode.

Each slot owns a KV buffer per layer, `[Hkv, max_context, D]`, filled from
position 0. A decode step stacks the active slots into one batch: their KV is
left-padded to the longest (`[B, Hkv, Lmax, D]`), a 2-D attention mask puts
zeros on the padding, and per-row `position_ids` keep RoPE positions true.
One forward runs, and each row's new K/V is written back into its slot. The
padding and the separate prefix forward are exactly the numerics that real
engines vary, so BF16 flips appear here for real and FP32 stays within ~1e-5.

This module knows nothing about HTTP, text or scheduling. torch is imported
here only; the engine package is loaded lazily by `tracekit serve`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EngineError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepOutput:
    """Per-row results of one forward, on CPU. B rows, k = top-k width.

    logits_dtype is the model's own output dtype: raw logits are exact values
    of that dtype (BF16 logits are exactly representable as floats).
    """
    chosen: torch.Tensor        # [B] int64, argmax (lowest id on exact ties) or sampled
    chosen_logprob: torch.Tensor  # [B] float32, natural log
    chosen_logit: torch.Tensor  # [B] float32, raw logit
    top_ids: torch.Tensor       # [B, k] int64, by logit descending
    top_logprobs: torch.Tensor  # [B, k] float32
    top_logits: torch.Tensor    # [B, k] float32


def default_model_dir() -> Path:
    """The fixture model shipped in the repository."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny"


class ModelRunner:
    """Loads a model directory and runs prefill / batched decode over slot KV buffers."""

    def __init__(self, model_dir: str | Path, dtype: str = "fp32", attn: str = "sdpa", device: str = "cpu",
                 slots: int = 4, max_context: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise EngineError(f"{path}: not a model directory (no config.json); pass --model DIR")
        if dtype not in DTYPES:
            raise EngineError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.device = torch.device(device)
        self.dtype_name, self.attn = dtype, attn
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn,
                                                          use_safetensors=True).to(self.device).eval()
        cfg = self.model.config
        tcfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.n_layers = int(tcfg.num_hidden_layers)
        self.n_kv = int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads)
        self.head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads)
        limit = int(getattr(tcfg, "max_position_embeddings", 2048))
        self.max_context = min(max_context or min(limit, 4096), limit)
        self.slots = slots
        self.eos_ids = self._eos_ids(path)
        # KV per layer: [slots, Hkv, max_context, D], model dtype.
        shape = (slots, self.n_kv, self.max_context, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.model.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.model.dtype, device=self.device) for _ in range(self.n_layers)]
        # transformers 5.2x renamed the forward keyword `past_key_values` to `cache`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.model_type = str(getattr(cfg, "model_type", "?"))

    def _eos_ids(self, path: Path) -> list[int]:
        ids: set[int] = set()
        gc = path / "generation_config.json"
        for src in ([json.loads(gc.read_text())] if gc.is_file() else []) + [self.model.config.to_dict()]:
            e = src.get("eos_token_id")
            ids.update([e] if isinstance(e, int) else (e or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def _forward(self, ids, pos, mask, cache):
        kw = {self._cache_kw: cache}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **kw)
        return out.logits[:, -1, :]  # [B, V], model dtype

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Run tokens[start:] on top of the slot's KV [0, start). Returns last-position logits [1, V]."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if start > 0:
            for layer in range(self.n_layers):
                cache.update(self.k[layer][slot:slot + 1, :, :start], self.v[layer][slot:slot + 1, :, :start], layer)
        ids = torch.tensor([tokens[start:]], device=self.device)
        pos = torch.arange(start, len(tokens), device=self.device)[None]
        logits = self._forward(ids, pos, None, cache)
        n = len(tokens)
        for layer, cl in enumerate(cache.layers):
            self.k[layer][slot, :, start:n] = cl.keys[0, :, start:n]
            self.v[layer][slot, :, start:n] = cl.values[0, :, start:n]
        return logits

    @torch.inference_mode()
    def decode(self, slots: list[int], lengths: list[int], next_ids: list[int]) -> torch.Tensor:
        """One batched decode step. Row i feeds next_ids[i] at position lengths[i] of slot slots[i].

        Returns logits [B, V]; each slot's KV grows by one position.
        """
        from transformers import DynamicCache

        b, lmax = len(slots), max(lengths)
        mask = torch.zeros(b, lmax + 1, dtype=torch.long, device=self.device)
        cache = DynamicCache()
        for layer in range(self.n_layers):
            kb = torch.zeros(b, self.n_kv, lmax, self.head_dim, dtype=self.model.dtype, device=self.device)
            vb = torch.zeros_like(kb)
            for i, (s, n) in enumerate(zip(slots, lengths)):  # left-pad: row i's KV ends at lmax
                kb[i, :, lmax - n:] = self.k[layer][s, :, :n]
                vb[i, :, lmax - n:] = self.v[layer][s, :, :n]
            cache.update(kb, vb, layer)
        for i, n in enumerate(lengths):
            mask[i, lmax - n:] = 1
        ids = torch.tensor(next_ids, device=self.device)[:, None]
        pos = torch.tensor(lengths, device=self.device)[:, None]
        logits = self._forward(ids, pos, mask, cache)
        si = torch.tensor(slots, device=self.device)
        li = torch.tensor(lengths, device=self.device)
        for layer, cl in enumerate(cache.layers):
            self.k[layer][si, :, li] = cl.keys[:, :, -1]  # [B, Hkv, D]
            self.v[layer][si, :, li] = cl.values[:, :, -1]
        return logits

    def kv_slice(self, slot: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the slot's KV for positions [start, end): per layer [Hkv, end-start, D]."""
        return ([self.k[layer][slot, :, start:end].clone() for layer in range(self.n_layers)],
                [self.v[layer][slot, :, start:end].clone() for layer in range(self.n_layers)])

    def load_kv(self, slot: int, start: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Write per-layer KV blocks [Hkv, n, D] into the slot at positions [start, start+n)."""
        n = ks[0].shape[1]
        for layer in range(self.n_layers):
            self.k[layer][slot, :, start:start + n] = ks[layer]
            self.v[layer][slot, :, start:start + n] = vs[layer]


def select(logits: torch.Tensor, k: int, temperature: list[float], gens: list) -> StepOutput:
    """Choose a token per row and gather top-k evidence. logits: [B, V] in model dtype.

    Log-probabilities are computed in float32 from the raw logits.
    """
    raw = logits.float()
    lp = torch.log_softmax(raw, dim=-1)
    chosen = torch.argmax(raw, dim=-1)  # first max index on exact ties
    for i, t in enumerate(temperature):
        if t > 0:
            probs = torch.softmax(raw[i] / t, dim=-1)
            chosen[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
    kk = max(k, 1)
    top_logits, top_ids = torch.topk(raw, kk, dim=-1)
    rows = torch.arange(raw.shape[0])
    return StepOutput(chosen=chosen.cpu(), chosen_logprob=lp[rows, chosen].cpu(), chosen_logit=raw[rows, chosen].cpu(),
                      top_ids=top_ids[:, :k].cpu(), top_logprobs=lp.gather(1, top_ids[:, :k]).cpu(),
                      top_logits=top_logits[:, :k].cpu())
