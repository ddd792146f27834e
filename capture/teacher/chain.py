"""Eager decode chains on CPU over a preallocated KV cache (no torch.cat a step).

A `decode` history ends in a chain of single-token forwards. transformers'
DynamicLayer grows the cache by `torch.cat` at every step: each of the G
steps copies every layer's whole K and V into fresh tensors (O(G * S) bytes,
and a fresh allocation a layer a step). Here the chain's cache layers are
swapped, for the chain only, for layers whose K/V live in one buffer sized
for the whole chain; a step writes its new key/value into the next slot and
hands the attention a view of the filled part. The steps are the very
forwards an eager chain makes (same inputs, same shapes, the same K/V
values), so the logits are bitwise the eager chain's (tested in fp32, bf16
and fp16): only the copies go.

Used on CPU for a cache of plain DynamicLayers holding plain tensors (not a
tensor-parallel shard, not an older transformers' cache without `layers`);
anything else runs the steps as before. On CUDA the chain runs as graphs
(graphs.py) or eagerly. torch and transformers are imported lazily.
"""

from __future__ import annotations

from typing import Any

STATS: dict = {"preallocated_chains": 0}  # read by tests and the benchmark


def applies(lm, cache) -> bool:
    """Whether a chain on this model and cache may run over a preallocated cache."""
    import torch
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        lm.device == "cpu"
        and bool(layers)
        and all(
            type(layer) is DynamicLayer
            and getattr(layer, "is_initialized", False)
            and type(layer.keys) is torch.Tensor
            and type(layer.values) is torch.Tensor
            for layer in layers
        )
    )


def _preallocated_layer(layer, capacity: int):
    """A DynamicLayer whose K/V are views of buffers of `capacity` positions (DynamicLayer.update
    replaced by a write into the next slots). Built lazily so that transformers is imported lazily."""
    from transformers.cache_utils import DynamicLayer

    global _Layer
    if _Layer is None:

        class _PreallocatedLayer(DynamicLayer):
            def update(self, key_states, value_states, *args, **kwargs):
                n, m = self.keys.shape[-2], key_states.shape[-2]
                if n + m > self._k.shape[-2]:  # past the chain: grow as DynamicLayer does
                    return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)
                self._k[..., n : n + m, :].copy_(key_states)
                self._v[..., n : n + m, :].copy_(value_states)
                self.keys, self.values = self._k[..., : n + m, :], self._v[..., : n + m, :]
                return self.keys, self.values

        _Layer = _PreallocatedLayer
    new = _Layer.__new__(_Layer)
    new.__dict__.update(layer.__dict__)  # device, is_initialized and whatever else this version keeps
    k, v = layer.keys, layer.values
    n = k.shape[-2]
    new._k = k.new_empty(k.shape[:-2] + (capacity, k.shape[-1]))
    new._v = v.new_empty(v.shape[:-2] + (capacity, v.shape[-1]))
    new._k[..., :n, :].copy_(k)
    new._v[..., :n, :].copy_(v)
    new.keys, new.values = new._k[..., :n, :], new._v[..., :n, :]
    return new


_Layer: Any = None


def preallocated_chain(lm, ids, start: int, cache, forward):
    """Logits [N, n - start, V] of the single-token steps start .. n-1 of ids [N, n] on `cache`
    (which holds keys for ids[:, :start]), each step `forward(lm, ids[:, p:p+1], cache, 1)` as an
    eager chain makes it. The cache's layers are replaced by preallocated ones (new objects and
    buffers: the tensors of the layers it had, which a forked sibling may share, are only read);
    it ends holding keys for ids[:, :n]."""
    n = ids.shape[1]
    cache.layers = [_preallocated_layer(layer, n) for layer in cache.layers]
    out = None
    for p in range(start, n):
        logits = forward(lm, ids[:, p : p + 1], cache, 1)  # [N, 1, V]
        if out is None:
            out = logits.new_empty((logits.shape[0], n - start, logits.shape[-1]))
        out[:, p - start].copy_(logits[:, -1])
    STATS["preallocated_chains"] += 1
    return out
