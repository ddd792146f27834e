"""The model executor: one HF causal LM, per-slot KV buffers, prefill and batched decode.

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

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import dtypes, hfcompat, modelinfo
from ..errors import ConfigError, EngineError
from .kernels import step_kernels
from .stepgraph import GRAPH_ATTNS, NoGraph, StepGraph
from .stepgraph import MODES as GRAPH_MODES

SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class StepOutput:
    """Per-row results of one forward, on CPU. B rows, k = top-k width.

    logits_dtype is the model's own output dtype: raw logits are exact values
    of that dtype (BF16 logits are exactly representable as floats).
    """

    chosen: torch.Tensor  # [B] int64, argmax (lowest id on exact ties) or sampled
    chosen_logprob: torch.Tensor  # [B] float32, natural log
    chosen_logit: torch.Tensor  # [B] float32, raw logit
    top_ids: torch.Tensor  # [B, k] int64, by logit descending
    top_logprobs: torch.Tensor  # [B, k] float32
    top_logits: torch.Tensor  # [B, k] float32
    errors: tuple = ()  # [B] None, or the exception that row's sampling raised (its chosen is the argmax)


def default_model_dir() -> Path:
    """The fixture model shipped in the repository."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny"


def check_model_dir(model_dir: str | Path) -> Path:
    """A servable model directory: config.json and safetensors weights. Pickled weights
    (pytorch_model.bin, *.pt) can run code when loaded, so they are refused, never loaded."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise EngineError(f"{path}: not a model directory (no config.json); pass --model DIR")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f"found only {', '.join(pickled)}" if pickled else "no weights found"
        raise EngineError(
            f"{path}: no *.safetensors weights ({found}); tracekit serve loads safetensors only "
            "(pickled weights can run code when loaded): re-save the model with transformers save_pretrained"
        )
    return path


class ModelExecutor:
    """Loads a model directory and runs prefill / batched decode over slot KV buffers."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "fp32",
        attn: str = "sdpa",
        device: str = "cpu",
        slots: int = 4,
        max_context: int | None = None,
        batch_invariant: bool = False,
        decode_graphs: str | None = None,
        fuse_projections: bool | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = check_model_dir(model_dir)
        try:
            torch_dtype = dtypes.torch_dtype(dtype)
        except ConfigError as e:
            raise EngineError(str(e)) from None
        self.device = torch.device(device)
        self.dtype_name, self.attn = dtype, attn
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=attn, use_safetensors=True
            )
            .to(self.device)
            .eval()
        )
        cfg = self.model.config
        tcfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.n_layers = int(tcfg.num_hidden_layers)
        self.n_kv = int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads)
        self.head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads)
        limit = int(getattr(tcfg, "max_position_embeddings", 2048))
        self.max_context = min(max_context or min(limit, 4096), limit)
        self.slots = slots
        self.batch_invariant = batch_invariant  # decode each row in its own forward (--batch-invariant)
        self.eos_ids = self._eos_ids(path)
        # All KV in one buffer, so a decode step gathers every layer's padded batch in one op:
        # [slots, layers, 2 (K, V), Hkv, max_context, D], model dtype.
        self.kv = torch.zeros(
            slots,
            self.n_layers,
            2,
            self.n_kv,
            self.max_context,
            self.head_dim,
            dtype=self.model.dtype,
            device=self.device,
        )
        self._cache_kw = hfcompat.cache_keyword(self.model)
        self._batch: _Batch | None = None  # the running decode batch; dropped when any slot is refilled
        self.model_type = str(getattr(cfg, "model_type", "?"))
        self.allow_cudnn = False  # True only to measure why it is off (tracekit/engine/kernels.py)
        self.fault = None  # faults_hooks.EngineFault (TESTING ONLY; None = healthy)
        # Decode steps as CUDA graphs with holes (stepgraph.py), bitwise the eager step: "graphs"
        # (default on CUDA with sdpa), "eager" (default elsewhere), "inline" (the same recorded path
        # without graphs, for CPU tests). One StepGraph per batch size, None where it cannot record.
        if decode_graphs is None:
            decode_graphs = "graphs" if self.device.type == "cuda" and attn in GRAPH_ATTNS else "eager"
        if decode_graphs not in GRAPH_MODES:
            raise EngineError(f"decode_graphs {decode_graphs!r}: one of {', '.join(GRAPH_MODES)}")
        if decode_graphs == "graphs" and self.device.type != "cuda":
            raise EngineError("decode_graphs 'graphs' needs a CUDA device (use 'inline' to test the path on CPU)")
        self.decode_graphs = decode_graphs
        # QKV and gate/up as one GEMM each at M <= slots, where that is bitwise the separate GEMMs
        # (fuse.py checks every shape and M at load): default on CUDA, off on CPU.
        if fuse_projections is None:
            fuse_projections = self.device.type == "cuda"
        self.fusion = {"groups_fused": 0, "enabled": False}
        if fuse_projections:
            from .fuse import fuse

            self.fusion = fuse(self.model, max_rows=slots)
            self.fusion["enabled"] = self.fusion["groups_fused"] > 0
        self._graphs: dict[int, StepGraph | None] = {}
        self.graph_log: list[str] = []  # batch sizes captured, and why any stayed eager
        self._capture_stream = None

    def _eos_ids(self, path: Path) -> list[int]:
        """What the model's files state (tracekit.modelinfo, the one reader). Only when they state
        nothing, the loaded tokenizer's own eos id: it can come from files modelinfo does not read
        (special_tokens_map.json, legacy vocab formats) or the tokenizer class's default, and the
        engine has to stop generating somewhere; /v1/models reports whatever it uses."""
        ids = list(modelinfo.eos_token_ids(path))
        if not ids and self.tokenizer.eos_token_id is not None:
            ids = [int(self.tokenizer.eos_token_id)]
        return ids

    def _forward(self, ids, pos, mask, cache, keep: int = 1):
        kw = {self._cache_kw: cache}
        # CUDA one-token steps never take cuDNN's attention kernel: not reproducible (kernels.py).
        with step_kernels(self.device, ids.shape[1], self.allow_cudnn):
            out = self.model(
                input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, logits_to_keep=keep, **kw
            )
        return out.logits[:, -1, :] if keep == 1 else out.logits[0]  # [B, V] or [keep, V], model dtype

    @torch.inference_mode()
    def prefill(
        self, slot: int, tokens: list[int], start: int, pos_shift: int = 0, all_logits: bool = False
    ) -> torch.Tensor:
        """Run tokens[start:] on top of the slot's KV [0, start). Returns last-position logits [1, V]
        (all_logits: every new position's, [len(tokens) - start, V], for prompt logprobs; the
        forward is the same, only the head runs on every row).
        pos_shift != 0 only under the injected fault hit-position-offset (RoPE positions off)."""
        from transformers import DynamicCache

        self._forget_batch(slot)
        # Not hfcompat.new_dynamic_cache: given the config, sliding-window layers would keep only
        # their window, and the slot needs every position's K/V back (the window is applied by the
        # model's mask, over the full KV).
        cache = DynamicCache()
        if start > 0:
            for layer in range(self.n_layers):
                kv = self.kv[slot, layer, :, :, :start]  # [2, Hkv, start, D]
                cache.update(kv[0][None], kv[1][None], layer)
        ids = torch.tensor([tokens[start:]], device=self.device)
        pos = torch.arange(start + pos_shift, len(tokens) + pos_shift, device=self.device)[None]
        logits = self._forward(ids, pos, None, cache, len(tokens) - start if all_logits else 1)
        n = len(tokens)
        for layer, cl in enumerate(cache.layers):
            self.kv[slot, layer, 0, :, start:n] = cl.keys[0, :, start:n]
            self.kv[slot, layer, 1, :, start:n] = cl.values[0, :, start:n]
        return logits

    @torch.inference_mode()
    def decode(self, slots: list[int], lengths: list[int], next_ids: list[int]) -> torch.Tensor:
        """One batched decode step. Row i feeds next_ids[i] at position lengths[i] of slot slots[i].

        Returns logits [B, V]; each slot's KV grows by one position. While the batch keeps its
        rows, its left-padded KV persists between steps and grows in place (no per-step copy).
        With batch_invariant, each row runs alone (a batch of one, no padding): bitwise what a
        serial run computes, whatever its batch mates.
        """
        if self.batch_invariant and len(slots) > 1:
            return torch.cat([self.decode([s], [n], [i]) for s, n, i in zip(slots, lengths, next_ids)])
        b = self._batch
        if b is None or b.slots != tuple(slots) or b.lengths != list(lengths) or b.n + 1 > b.cap:
            b = self._batch = self._build_batch(slots, lengths)
        dev = self.device
        b.mask[:, b.n] = 1
        cache = b.cache()
        li = torch.tensor(lengths, device=dev)
        ids = torch.tensor(next_ids, device=dev)[:, None]
        if self.fault is None and self.decode_graphs != "eager" and not self.allow_cudnn:
            logits = self._graph_step(b, cache, li, ids)
        elif self.fault is None:
            logits = self._forward(ids, li[:, None], b.mask[:, : b.n + 1], cache)
        else:
            with self.fault.scaled(self.model, len(slots)):
                logits = self._forward(ids, li[:, None], b.mask[:, : b.n + 1], cache)
            self.fault.after_decode(b.kv, b.n, next_ids, lengths)
        # Keep the slot buffers current (prefix cache, rebuilds): one [B, L, 2, Hkv, D] scatter.
        new = b.kv[:, :, :, :, b.n].permute(2, 0, 1, 3, 4)  # [L, 2, B, Hkv, D] -> [B, L, 2, Hkv, D]
        self.kv[torch.tensor(slots, device=dev), :, :, :, li] = new
        b.n += 1
        b.lengths = [n + 1 for n in lengths]
        return logits

    def _graph_step(self, b: "_Batch", cache, li: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The step through this batch size's StepGraph: its first step runs eagerly (on the
        capture stream, which it warms) and records the graphs; every later one replays them.
        Bitwise the eager step (stepgraph.py); a batch size that cannot record stays eager."""
        bsz, mask, pos = len(b.slots), b.mask[:, : b.n + 1], li[:, None]
        sg = self._graphs.get(bsz, False)
        if sg is None:
            return self._forward(ids, pos, mask, cache)
        if sg is not False:
            with step_kernels(self.device, 1, False):
                return sg.run(cache, mask, ids, pos)
        if self.decode_graphs == "graphs":
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(device=self.device)
            stream = self._capture_stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._forward(ids, pos, mask, cache)
            torch.cuda.current_stream().wait_stream(stream)
            logits.record_stream(torch.cuda.current_stream())  # made on the capture stream, read on this one
        else:
            logits = self._forward(ids, pos, mask, cache)
        try:
            sg = StepGraph(self.model, self._cache_kw, bsz, self.device, self.decode_graphs)
            sg.capture(b.cache(), mask, ids, pos, self._capture_stream)
            self.graph_log.append(f"batch {bsz}: recorded ({self.decode_graphs})")
        except NoGraph as e:
            sg = None
            self.graph_log.append(f"batch {bsz}: eager ({e})")
        self._graphs[bsz] = sg
        return logits

    def graph_report(self) -> dict:
        """For the engine's self-report (/v1/models meta.decode_graphs)."""
        items = list(self._graphs.items())  # read from the HTTP thread while the owner loop may add one
        return {
            "mode": self.decode_graphs,
            "batch_sizes": sorted(k for k, v in items if v is not None),
            "eager_batch_sizes": sorted(k for k, v in items if v is None),
            "log": self.graph_log[-16:],
            "fused_projections": {k: v for k, v in self.fusion.items() if not k.startswith("_")},
        }

    def _build_batch(self, slots: list[int], lengths: list[int]) -> "_Batch":
        """Gather the slots' KV left-padded to the longest, with headroom to grow in place."""
        bsz, lmax, dev = len(slots), max(lengths), self.device
        cap = min(lmax + 64, self.max_context)
        si, li = torch.tensor(slots, device=dev), torch.tensor(lengths, device=dev)
        # Row i's column j < lmax holds slot position j - (lmax - n_i); padding gathers position 0
        # (any finite value works: the mask gives it zero weight).
        src = torch.arange(lmax, device=dev)[None, :] - (lmax - li)[:, None]  # [B, lmax]
        kv = torch.zeros(self.n_layers, 2, bsz, self.n_kv, cap, self.head_dim, dtype=self.model.dtype, device=dev)
        kv[..., :lmax, :] = self.kv[si[:, None], :, :, :, src.clamp(min=0)].permute(2, 3, 0, 4, 1, 5)
        mask = torch.zeros(bsz, cap, dtype=torch.long, device=dev)
        mask[:, :lmax] = (src >= 0).long()
        if self.fault is not None:
            self.fault.open_pad(mask, lmax - li)
        return _Batch(tuple(slots), list(lengths), kv, mask, lmax, cap)

    def drop_batch(self) -> None:
        """Forget the running decode batch (after a failed step its buffer may be half-written);
        the next step rebuilds it from the slots' own KV."""
        self._batch = None

    def _forget_batch(self, slot: int) -> None:
        """A slot refilled for a new request invalidates the running batch that holds it."""
        if self._batch is not None and slot in self._batch.slots:
            self._batch = None

    def kv_slice(self, slot: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the slot's KV for positions [start, end): per layer [Hkv, end-start, D]."""
        return (
            [self.kv[slot, layer, 0, :, start:end].clone() for layer in range(self.n_layers)],
            [self.kv[slot, layer, 1, :, start:end].clone() for layer in range(self.n_layers)],
        )

    def load_kv(self, slot: int, start: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Write per-layer KV blocks [Hkv, n, D] into the slot at positions [start, start+n)."""
        n = ks[0].shape[1]
        self._forget_batch(slot)
        for layer in range(self.n_layers):
            self.kv[slot, layer, 0, :, start : start + n] = ks[layer]
            self.kv[slot, layer, 1, :, start : start + n] = vs[layer]


class _Batch:
    """A decode batch's KV: [L, 2, B, Hkv, cap, D], rows left-padded so all end at column n."""

    def __init__(self, slots, lengths, kv, mask, n, cap):
        self.slots, self.lengths, self.kv, self.mask, self.n, self.cap = slots, lengths, kv, mask, n, cap

    def cache(self):
        """A DynamicCache whose layers append in place into this batch's buffer."""
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.layers[:] = [
            _SlabLayer(self.kv[layer, 0], self.kv[layer, 1], self.n) for layer in range(self.kv.shape[0])
        ]
        return cache


def _slab_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """A DynamicLayer over a preallocated [B, Hkv, cap, D] buffer: update writes in place."""

        def __init__(self, kbuf, vbuf, n):
            super().__init__()
            self.kbuf, self.vbuf, self.n = kbuf, vbuf, n
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]
            self.is_initialized, self.device = True, kbuf.device

        def update(self, key_states, value_states, *args, **kwargs):
            t = key_states.shape[-2]
            self.kbuf[:, :, self.n : self.n + t] = key_states
            self.vbuf[:, :, self.n : self.n + t] = value_states
            self.n += t
            self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]
            return self.keys, self.values

    return SlabLayer


_SLAB = None


def _SlabLayer(kbuf, vbuf, n):
    global _SLAB
    if _SLAB is None:
        _SLAB = _slab_layer_class()
    return _SLAB(kbuf, vbuf, n)


def select(logits: torch.Tensor, k: int, temperature: list[float], gens: list) -> StepOutput:
    """Choose a token per row and gather top-k evidence. logits: [B, V] in model dtype.

    Log-probabilities are computed in float32 from the raw logits.
    """
    raw = logits.float()
    lp = torch.log_softmax(raw, dim=-1)
    chosen = torch.argmax(raw, dim=-1)  # first max index on exact ties
    errors: list = [None] * raw.shape[0]
    for i, t in enumerate(temperature):
        # Below SAMPLING_EPS (vLLM's convention) sampling is greedy: logits / 1e-45 overflow to
        # inf, and their softmax to NaN.
        if t >= SAMPLING_EPS:
            try:
                probs = torch.softmax(raw[i] / t, dim=-1)
                chosen[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
            except (RuntimeError, ValueError, TypeError) as e:  # one row's bad sampling, not the batch's
                errors[i] = e
    kk = max(k, 1)
    top_logits, top_ids = torch.topk(raw, kk, dim=-1)
    rows = torch.arange(raw.shape[0])
    return StepOutput(
        chosen=chosen.cpu(),
        chosen_logprob=lp[rows, chosen].cpu(),
        chosen_logit=raw[rows, chosen].cpu(),
        top_ids=top_ids[:, :k].cpu(),
        top_logprobs=lp.gather(1, top_ids[:, :k]).cpu(),
        top_logits=top_logits[:, :k].cpu(),
        errors=tuple(errors),
    )
