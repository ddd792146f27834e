"""Decode chains as CUDA graphs with the attention left eager ("holes").

A `decode` history ends in a chain of single-token forwards over one batch.
Every step of the chain has the same shapes except the attention, whose key
length grows by one a step. So one step is captured as CUDA graphs cut at
every attention call, and replayed for the others:

    graph 0      embedding, rotary, layer 0 up to its attention
    hole 0       the cache update (the new key/value written into the chain's
                 preallocated K/V buffer, chain.py) and the loaded attention
                 function, run eagerly on the grown cache's view, exactly as
                 an eager step calls it
    graph 1      layer 0's o_proj, MLP, ..., layer 1 up to its attention
    ...
    graph L      the last layer's tail, the final norm and the LM head

The graphs replay the very kernels an eager step launches, on the same
shapes, and the holes make the very calls an eager step makes, so a graphed
chain gives the same logits as the eager one (a CUDA test checks them
bitwise); only the host work goes: an eager step of a Qwen3-4B shape
launches ~1,800 kernels one by one, a graphed step launches L + 1 graphs
and ~4 kernels a layer.

Used only where that holds: CUDA, one device (not a `device_map` model
spread over GPUs), `sdpa` or `sdpa_lower_right` attention (whose
single-token call takes no mask), a cache of plain DynamicLayers, no mask at
capture. Anything else raises NoGraph during capture and the
chain runs eagerly. One step of each chain runs eagerly first (on the
capture stream: it warms the stream's cuBLAS handle and is the chain's
first step), then one step is captured; capture launches nothing, so its
step is then replayed like every other.

`mode="inline"` runs the same patching and holes without graphs (the holes
compute the attention in place): it lets CPU tests check the plumbing
against a transformers version. torch is imported lazily.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

HOLE = "tracekit_graph_hole"
GRAPH_ATTNS = ("sdpa", "sdpa_lower_right")
MIN_STEPS = 4  # a chain shorter than this is not worth one capture

_ACTIVE: list = []  # the recorder of the forward being captured (one at a time)
# What happened to chains in this process (read by tests and the benchmark).
STATS: dict = {"graphed_chains": 0, "graphed_steps": 0, "fallbacks": []}


class NoGraph(Exception):
    """This model or cache cannot run a step as graphs with holes."""


@dataclass
class _Hole:
    layer_idx: int
    key: Any  # the step's new key/value, written by the graph before the hole
    value: Any
    update_args: tuple
    update_kwargs: dict
    module: Any
    query: Any
    attn_kwargs: dict
    out: Any = None  # the attention output, read by the graph after the hole


class _Recorder:
    """Patches one cache and the attention for one step, and records it."""

    def __init__(self, cache, real_attention, capture: bool):
        self.cache = cache
        self.real_attention = real_attention
        self.capture = capture
        self.graphs: list = []
        self.holes: list[_Hole] = []
        self.pending = None
        self.pool = None

    def begin(self) -> None:
        import torch

        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g.capture_begin(pool=self.pool)
        self.graphs.append(g)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def abort(self) -> None:
        """End a capture that failed; the graphs are dropped."""
        try:
            self.end()
        except Exception:  # noqa: BLE001 - the capture may already be invalidated
            pass
        self.graphs.clear()

    def update(self, key, value, layer_idx, *args, **kwargs):
        """Stands in for cache.update while recording."""
        if self.pending is not None:
            raise NoGraph("a cache update without an attention call after it")
        self.pending = (layer_idx, key, value, args, kwargs)
        if not self.capture:
            return type(self.cache).update(self.cache, key, value, layer_idx, *args, **kwargs)
        return key, value  # shapes only: the hole makes the real update at replay

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """Stands in for the attention function while recording."""
        import torch

        if (
            attention_mask is not None
            or query.shape[2] != 1
            or self.pending is None
            or kwargs.get("position_bias") is not None
        ):
            raise NoGraph("the step's attention takes a mask, a bias or more than one query")
        layer_idx, k, v, uargs, ukw = self.pending
        self.pending = None
        hole = _Hole(layer_idx, k, v, uargs, ukw, module, query, kwargs)
        self.holes.append(hole)
        if not self.capture:
            return self.real_attention(module, query, key, value, None, **kwargs)
        self.end()
        # real_attention returns attn_output.transpose(1, 2).contiguous(): [N, q, H, Dv]
        hole.out = torch.empty(
            (query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype, device=query.device
        )
        self.begin()
        return hole.out, None

    def replay(self) -> None:
        self.graphs[0].replay()
        for hole, g in zip(self.holes, self.graphs[1:]):
            k, v = self.cache.update(hole.key, hole.value, hole.layer_idx, *hole.update_args, **hole.update_kwargs)
            out, _ = self.real_attention(hole.module, hole.query, k, v, None, **hole.attn_kwargs)
            hole.out.copy_(out)
            g.replay()


def _dispatch_attention(module, query, key, value, attention_mask, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"attention '{HOLE}' called outside a tracekit graph capture")
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, **kwargs)


def _registered(name: str):
    """(attention function, mask function) registered under `name`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name], ALL_MASK_ATTENTION_FUNCTIONS[name]


def _capture_mask(loaded_mask):
    """The loaded attention's mask function, minus one capture artefact.

    transformers skips the causal mask of a one-token step without padding
    (SDPA runs it unmasked) but not while a CUDA stream is capturing, which
    its `is_tracing` counts as tracing; the captured step would then carry a
    mask that the eager step does not. Without a padding mask this returns
    None, as the eager step's builder does; with one, the loaded builder
    (whose mask makes the capture refuse, NoGraph).
    """

    def mask(*args, attention_mask=None, **kwargs):
        if attention_mask is None:
            return None
        return loaded_mask(*args, attention_mask=attention_mask, **kwargs)

    return mask


@contextmanager
def _recording(model, cache, rec: _Recorder, loaded: str):
    """Route the model's attention through `rec` (as HOLE) and its cache updates too."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HOLE, _dispatch_attention)
    AttentionMaskInterface.register(HOLE, _capture_mask(_registered(loaded)[1]))
    _ACTIVE.append(rec)
    cache.update = rec.update  # instance attribute: shadows the class method for this cache only
    model.config._attn_implementation = HOLE
    try:
        yield
    finally:
        model.config._attn_implementation = loaded
        del cache.update
        _ACTIVE.pop()


def graphable(lm, cache) -> bool:
    """Whether a chain on this model and cache may be tried as graphs."""
    from transformers.cache_utils import DynamicLayer

    loaded = getattr(lm.model.config, "_attn_implementation", None)
    layers = getattr(cache, "layers", None)
    placed = set((getattr(lm.model, "hf_device_map", None) or {}).values())
    return (
        lm.device.startswith("cuda")
        and loaded in GRAPH_ATTNS
        and layers is not None
        and len(placed) <= 1
        and all(type(layer) is DynamicLayer for layer in layers)
    )


def _step_inputs(lm, ids_col, pos: int) -> dict:
    """Static inputs of one step: token ids [N, 1], position_ids [1, 1] and,
    where the forward still takes it, cache_position [1] (transformers < 5.2x)."""
    import torch

    kw = {
        "input_ids": ids_col.clone(),
        "position_ids": torch.full((1, 1), pos, dtype=torch.long, device=ids_col.device),
    }
    if "cache_position" in inspect.signature(lm.model.forward).parameters:
        kw["cache_position"] = torch.full((1,), pos, dtype=torch.long, device=ids_col.device)
    return kw


def _set_step(inputs: dict, ids_col, pos: int) -> None:
    inputs["input_ids"].copy_(ids_col)
    inputs["position_ids"].fill_(pos)
    if "cache_position" in inputs:
        inputs["cache_position"].fill_(pos)


def _model_step(lm, cache, inputs: dict):
    out = lm.model(**inputs, use_cache=True, logits_to_keep=1, **{lm.cache_kw: cache})
    return out.logits


def _preallocate(cache, capacity: int) -> None:
    """The cache's layers swapped for layers over buffers of `capacity` positions (chain.py):
    a hole's update writes the step's key/value into the next slot and hands the attention a
    view, where DynamicLayer.update would torch.cat every layer's whole K and V into fresh
    tensors a step (at 8 x 2,048 positions of a Qwen3-4B shape, 2.4 GB copied a step). The
    attention reads the same values through a strided view: bitwise the eager chain's (the CUDA
    test compares the graphed chain with an eager chain on transformers' own cache)."""
    import torch
    from transformers.cache_utils import DynamicLayer

    from .chain import STATS as CHAIN_STATS
    from .chain import _preallocated_layer

    layers = getattr(cache, "layers", None)
    if layers and all(
        type(layer) is DynamicLayer
        and getattr(layer, "is_initialized", False)
        and type(layer.keys) is torch.Tensor
        and layer.keys.shape[-2] < capacity
        for layer in layers
    ):
        cache.layers = [_preallocated_layer(layer, capacity) for layer in layers]
        CHAIN_STATS["preallocated_chains"] += 1


def decode_chain(lm, ids, start: int, cache, mode: str = "graphs"):
    """Logits [N, n - start, V] of the single-token steps start .. n-1 of ids
    [N, n] on `cache` (which holds keys for ids[:, :start]); the cache grows
    to n. mode: graphs (CUDA) or inline (CPU tests: the same patching, no
    graphs). Raises NoGraph before touching the cache when the model cannot
    be recorded; a failure during capture falls back to eager steps."""
    import torch

    n = ids.shape[1]
    steps = n - start
    loaded = lm.model.config._attn_implementation
    if loaded not in GRAPH_ATTNS:
        raise NoGraph(f"attention {loaded!r}: only {', '.join(GRAPH_ATTNS)} run without a mask at one query")
    real_attention = _registered(loaded)[0]
    _preallocate(cache, n)
    out = None
    first = 0
    if mode == "graphs":
        stream = torch.cuda.Stream(device=ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # the chain's first step, eagerly, on the capture stream (warms its cuBLAS handle)
            logits = _model_step(lm, cache, {"input_ids": ids[:, start : start + 1]})
            out = logits.new_empty((ids.shape[0], steps, logits.shape[-1]))
            out[:, 0].copy_(logits[:, -1])
            first = 1
        torch.cuda.current_stream().wait_stream(stream)
    pos = start + first
    inputs = _step_inputs(lm, ids[:, pos : pos + 1], pos)
    rec = _Recorder(cache, real_attention, capture=mode == "graphs")
    if mode == "graphs":
        torch.cuda.synchronize()
        with torch.cuda.stream(stream), _recording(lm.model, cache, rec, loaded):
            rec.begin()
            try:
                logits = _model_step(lm, cache, inputs)
                rec.end()
            except Exception as e:  # noqa: BLE001 - any capture failure: finish the chain eagerly
                rec.abort()
                logits = None
                STATS["fallbacks"].append(f"{type(e).__name__}: {e}")
        torch.cuda.current_stream().wait_stream(stream)
        if logits is not None and (len(rec.holes) != len(cache.layers) or len(rec.graphs) != len(rec.holes) + 1):
            STATS["fallbacks"].append(f"{len(rec.holes)} attention calls for {len(cache.layers)} cache layers")
            logits = None
        if logits is None:
            # nothing of the captured step ran; finish the chain eagerly
            for p in range(pos, n):
                out[:, p - start].copy_(_model_step(lm, cache, {"input_ids": ids[:, p : p + 1]})[:, -1])
            return out
        for p in range(pos, n):  # the captured step launched nothing: replay it too
            if p > pos:
                _set_step(inputs, ids[:, p : p + 1], p)
            rec.replay()
            out[:, p - start].copy_(logits[:, -1])
        STATS["graphed_chains"] += 1
        STATS["graphed_steps"] += n - pos
        return out
    if mode != "inline":
        raise ValueError(f"mode {mode!r}")
    pieces = []
    for p in range(pos, n):
        _set_step(inputs, ids[:, p : p + 1], p)
        rec.holes.clear()
        with _recording(lm.model, cache, rec, loaded):
            pieces.append(_model_step(lm, cache, inputs)[:, -1:])
        if len(rec.holes) != len(cache.layers):
            raise NoGraph(f"{len(rec.holes)} attention calls for {len(cache.layers)} cache layers")
    return torch.cat(pieces, dim=1)
