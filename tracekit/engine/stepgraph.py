"""The engine's batched decode step as CUDA graphs with holes, bitwise the eager step.

An eager decode step of a Qwen3-4B shape launches ~1,800 kernels one by one
from Python (30.6 ms a step at 8 rows on an H200, 14x its bandwidth floor,
bench/RESULTS.md). Every kernel of the step has the same shapes at every step
of one batch size except three things: the attention (its key length grows
by one a step), the cache write (the new key/value go to column n of the
batch's buffer) and the attention masks (built by transformers from the
step's 2-D padding mask). So one step per batch size is captured as CUDA
graphs cut at every attention call, and replayed for every later step of
that batch size, whatever the rows, their lengths or the batch buffer:

    masks        transformers' own mask functions (create_causal_mask, the
                 sliding-window one, ...), called eagerly before the
                 replay with the arguments the model passed them at
                 capture, the cache and the 2-D mask swapped for this
                 step's: exactly the masks an eager step builds
    graph 0      embedding, rotary, layer 0 up to its attention
    hole i       the cache write (DynamicCache.update on this step's
                 cache) and the loaded attention function with this
                 step's mask, run eagerly, exactly as an eager step calls
                 them
    graph i + 1  layer i's o_proj, MLP, ..., layer i + 1 up to its attention
    graph L      the last layer's tail, the final norm and the LM head

The graphs replay the very kernels an eager step launches on the same
shapes, and masks and holes make the very calls an eager step makes, so the
logits are bitwise the eager step's (a CUDA check in bench/gpu_study; on
CPU, mode "inline" runs the same patching, deferred masks and holes without
graphs, and tests assert it bitwise equal to the eager path). The graphs do
not refer to the batch buffer at all (the holes do), so one capture per
batch size serves the whole life of the engine.

Only where that holds: CUDA, `sdpa` attention, a forward whose mask
functions are module-level names of the model's modeling module (Qwen3,
Llama, Gemma3 text and most decoders), no injected fault. Anything else
raises NoGraph at capture, and that batch size stays eager. The design
follows the teacher-forced diagnostic's decode chains
(tracekit/capture/teacher/graphs.py), which cannot be imported from here
(the engine is core); this one adds the deferred masks and a per-replay
cache. torch is imported lazily.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

HOLE = "tracekit_engine_hole"
GRAPH_ATTNS = ("sdpa",)
MODES = ("eager", "graphs", "inline")

_ACTIVE: list = []  # the recorder of the forward being recorded (one at a time)


class NoGraph(Exception):
    """This model or step cannot run as graphs with holes."""


class _Deferred:
    """Stands in for a mask while recording: the hole resolves it at replay."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"<deferred mask {self.index}>"


@dataclass
class _Hole:
    layer_idx: int
    key: Any  # the step's new key/value, written by the graph before the hole
    value: Any
    update_args: tuple
    update_kwargs: dict
    module: Any
    query: Any
    mask: Any  # None or a _Deferred
    attn_kwargs: dict
    out: Any = None  # the attention output, read by the graph after the hole


def _registered_attention(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"attention '{HOLE}' called outside a tracekit step recording")
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, **kwargs)


def _mask_names(model) -> tuple[Any, list[str]]:
    """The modeling module of `model` and its names bound to transformers' mask builders."""
    mod = sys.modules.get(type(model).__module__)
    if mod is None:
        raise NoGraph(f"no module for {type(model).__name__}")
    names = [
        n
        for n, v in vars(mod).items()
        if callable(v)
        and getattr(v, "__module__", "") == "transformers.masking_utils"
        and n.startswith("create_")
        and "mask" in n
    ]
    return mod, names


class StepGraph:
    """One batch size's decode step, recorded once and replayed (graphs) or re-run inline."""

    def __init__(self, model, cache_kw: str, batch: int, device, mode: str):
        import torch

        if mode not in ("graphs", "inline"):
            raise ValueError(f"mode {mode!r}")
        self.model, self.cache_kw, self.batch, self.mode = model, cache_kw, batch, mode
        self.loaded = model.config._attn_implementation
        if self.loaded not in GRAPH_ATTNS:
            raise NoGraph(f"attention {self.loaded!r}: graphs run only {', '.join(GRAPH_ATTNS)}")
        self.real_attention = _registered_attention(self.loaded)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.graphs: list = []
        self.holes: list[_Hole] = []
        self.mask_calls: list = []  # (real function, args, kwargs) as the model called them at capture
        self.masks: list = []  # this step's resolved masks, by _Deferred.index
        self.cap_cache = self.cap_mask = None  # what the recorded mask calls refer to
        self.logits = None
        self.pool = None
        self.pending = None
        self.recording = False  # inside a recorded forward
        self.capturing = False  # recording into CUDA graphs (mode graphs)
        self.cache = None  # the cache the holes write (this step's)
        self.steps = 0

    # -- recording -----------------------------------------------------------------------------

    def _begin(self) -> None:
        import torch

        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g.capture_begin(pool=self.pool)
        self.graphs.append(g)

    def _end(self) -> None:
        self.graphs[-1].capture_end()

    def update(self, key, value, layer_idx, *args, **kwargs):
        """Stands in for cache.update while recording (the hole makes the real one)."""
        if self.pending is not None:
            raise NoGraph("a cache update without an attention call after it")
        self.pending = (layer_idx, key, value, args, kwargs)
        if not self.capturing:  # inline: the masks first (before any cache write), then the write
            if not self.holes:
                self._inline_masks()
            return type(self.cache).update(self.cache, key, value, layer_idx, *args, **kwargs)
        return key, value  # shapes only

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """Stands in for the attention function while recording."""
        import torch

        if attention_mask is not None and not isinstance(attention_mask, _Deferred):
            raise NoGraph("a mask the recorder did not defer (built outside the modeling module's mask names)")
        if query.shape[2] != 1 or self.pending is None or kwargs.get("position_bias") is not None:
            raise NoGraph("the step's attention takes a bias, more than one query or no cache update")
        layer_idx, k, v, uargs, ukw = self.pending
        self.pending = None
        hole = _Hole(layer_idx, k, v, uargs, ukw, module, query, attention_mask, kwargs)
        self.holes.append(hole)
        if not self.capturing:  # inline: the hole runs now, on masks resolved as a replay does
            return self.real_attention(module, query, key, value, self._mask(attention_mask), **kwargs)
        self._end()
        # the attention function returns attn_output.transpose(1, 2).contiguous(): [N, q, H, Dv]
        hole.out = torch.empty(
            (query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype, device=query.device
        )
        self._begin()
        return hole.out, None

    def _deferring(self, real):
        def deferred(*args, **kwargs):
            if not self.recording:  # another caller of the module's name (never during a step)
                return real(*args, **kwargs)
            self.sink.append((real, args, kwargs))
            return _Deferred(len(self.sink) - 1)

        return deferred

    @contextmanager
    def _recording(self, cache, mask2d):
        from transformers import AttentionInterface

        mod, names = _mask_names(self.model)
        saved = {n: getattr(mod, n) for n in names}
        AttentionInterface.register(HOLE, _dispatch)
        _ACTIVE.append(self)
        self.cache, self.mask2d = cache, mask2d
        self.sink, self.holes, self.pending = [], [], None
        cache.update = self.update  # an instance attribute: shadows the class method for this cache only
        for n in names:
            setattr(mod, n, self._deferring(saved[n]))
        self.model.config._attn_implementation = HOLE
        self.recording = True
        try:
            yield
        finally:
            self.recording = False
            self.model.config._attn_implementation = self.loaded
            for n, f in saved.items():
                setattr(mod, n, f)
            del cache.update
            _ACTIVE.pop()

    def _forward(self, cache, mask2d):
        kw = {self.cache_kw: cache}
        out = self.model(
            input_ids=self.ids, position_ids=self.pos, attention_mask=mask2d, use_cache=True, logits_to_keep=1, **kw
        )
        return out.logits

    # -- masks ---------------------------------------------------------------------------------

    def _resolve_masks(self, cache, mask2d) -> None:
        """This step's masks: each recorded mask call again, on this step's cache and 2-D mask."""

        def sub(x):
            if x is self.cap_cache:
                return cache
            if x is self.cap_mask:
                return mask2d
            return x

        cfg = self.model.config
        impl, cfg._attn_implementation = cfg._attn_implementation, self.loaded
        try:
            self.masks = [
                real(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})
                for real, args, kwargs in self.mask_calls
            ]
        finally:
            cfg._attn_implementation = impl

    def _mask(self, m):
        return None if m is None else self.masks[m.index]

    # -- the step ------------------------------------------------------------------------------

    def capture(self, cache, mask2d, ids, pos, stream=None) -> None:
        """Record the step (graphs: capture on `stream`, a side stream best warmed by an eager
        step; nothing runs). Raises NoGraph."""
        import torch

        self.ids.copy_(ids)
        self.pos.copy_(pos)
        if not _mask_names(self.model)[1]:
            # masks built elsewhere could not be deferred: a capture-time None would stand for
            # every later step's mask (padding, windows), silently
            raise NoGraph(f"{type(self.model).__module__} has no mask builder names to defer")
        if self.mode == "inline":
            return
        n_layers = len(cache.layers)
        stream = stream or torch.cuda.Stream(device=self.ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        self.capturing = True
        try:
            with torch.cuda.stream(stream), self._recording(cache, mask2d):
                self._begin()
                try:
                    logits = self._forward(cache, mask2d)
                    self._end()
                except Exception as e:  # noqa: BLE001 - any capture failure: this batch size stays eager
                    try:
                        self._end()
                    except Exception:  # noqa: BLE001 - the capture may already be invalidated
                        pass
                    self.graphs.clear()
                    raise NoGraph(f"capture failed: {type(e).__name__}: {e}") from e
        finally:
            self.capturing = False
            torch.cuda.current_stream().wait_stream(stream)
        if len(self.holes) != n_layers or len(self.graphs) != n_layers + 1 or not self.sink:
            self.graphs.clear()
            raise NoGraph(f"{len(self.holes)} attention calls for {n_layers} cache layers, {len(self.sink)} masks")
        self.mask_calls, self.cap_cache, self.cap_mask = self.sink, cache, mask2d
        self.logits = logits

    def run(self, cache, mask2d, ids, pos):
        """One step on `cache` (this step's DynamicCache): logits [B, V], a fresh tensor."""
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.steps += 1
        if self.mode == "inline":
            return self._inline(cache, mask2d)
        self._resolve_masks(cache, mask2d)
        self.graphs[0].replay()
        for hole, g in zip(self.holes, self.graphs[1:]):
            k, v = type(cache).update(
                cache, hole.key, hole.value, hole.layer_idx, *hole.update_args, **hole.update_kwargs
            )
            out, _ = self.real_attention(hole.module, hole.query, k, v, self._mask(hole.mask), **hole.attn_kwargs)
            hole.out.copy_(out)
            g.replay()
        return self.logits[:, -1, :].clone()

    def _inline(self, cache, mask2d):
        """The recorded path without graphs (CPU tests): the model runs with the hole attention
        and deferred masks, and the masks come from the FIRST step's recorded calls with this
        step's cache and 2-D mask swapped in, exactly as a replay resolves them."""
        with self._recording(cache, mask2d):
            logits = self._forward(cache, mask2d)
        if len(self.holes) != len(cache.layers) or not self.sink:
            raise NoGraph(
                f"{len(self.holes)} attention calls for {len(cache.layers)} cache layers, {len(self.sink)} masks"
            )
        return logits[:, -1, :]

    def _inline_masks(self) -> None:
        """At the first cache write of an inline step (before it: the state an eager step builds
        its masks in): the first step's calls become the template; every step resolves it."""
        if not self.mask_calls and self.steps == 1:
            self.mask_calls, self.cap_cache, self.cap_mask = self.sink, self.cache, self.mask2d
        if len(self.sink) != len(self.mask_calls):
            raise NoGraph(f"{len(self.sink)} mask calls in this step, {len(self.mask_calls)} recorded")
        self._resolve_masks(self.cache, self.mask2d)
