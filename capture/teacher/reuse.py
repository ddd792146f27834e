"""Root segments taken from a longer forward, where that is verified bitwise for the shape.

At the trie's root every child segment [0, b) runs from an empty cache. When a
sibling computes a longer [0, S) from an empty cache too (`full`'s forward over
everything, say), the K/V of [0, b) are already in that forward's cache and the
logits at the scored positions of [0, b) in its logits, provided the two
forwards compute those positions in the same order. They do on some shapes
and not on others (on a 2-core CPU, FP32, tiny shape: b = 480 and 496 of
S = 511 bitwise, b = 240, 256 and 479 not): kernels block rows, keys and
vector lanes by shape. So nothing is assumed: the first time a shape is seen
both forwards run and are compared (`torch.equal` on every layer's K and V,
and on the scored logits), and the verdict is kept per shape in the
LoadedModel (`prefix_verdicts`). Only a True verdict is reused; False runs the
[0, b) forward as before. While verifying, the outputs are the separate
forwards' own, so every history's logits are always what they were without
reuse.

The assumption (docs/diagnostic.md, "Prefix reuse"): kernels are
deterministic, so for fixed shapes the reduction order does not depend on the
values; a verdict measured on one batch holds for every batch of that shape.
A shape whose order differs cannot pass by chance: it would need every one of
the N * b * layers * heads * head_dim K/V values to round alike.

Applies to caches of plain DynamicLayers (not sliding-window layers, whose
state is more than K/V) and never under TP (each rank would verify alone and
might then run different forwards, so their collectives would not pair up;
load_model turns it off there). When the longest sibling is a leaf (no later
segment, so it ran without a cache), reuse runs it with a cache: its logits
with a cache are verified against those without, per shape, too.

torch and transformers are imported lazily.
"""

from __future__ import annotations

import copy

from tracekit.hfcompat import new_dynamic_cache

# read by tests, the benchmark and the diagnostic's summary:
# reused: [0, b) segments taken from a longer forward; verified: shapes compared (one extra forward
# or none each); failed: those comparisons that found a difference (their shapes fall back from then on)
STATS: dict = {"reused": 0, "verified": 0, "failed": 0}


def bitwise_equal(a, b) -> bool:
    """Whether two lists of tensors are equal bit for bit (one place for tests to force a failure)."""
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def applies(lm, cache) -> bool:
    """Whether K/V [0, b) may be sliced from `cache` (every layer a plain, filled DynamicLayer)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        type(layer) is DynamicLayer and getattr(layer, "is_initialized", False) for layer in layers
    )


def _key(lm, *shape) -> tuple:
    attn = getattr(lm.model.config, "_attn_implementation", None)  # read at every forward: may change
    return (attn, lm.dtype, lm.device, *shape)


def _kv(cache, b: int | None = None) -> list:
    """Every layer's K and V ([N, H, b, D]), cut to the first b positions."""
    out = []
    for layer in cache.layers:
        out += [layer.keys[..., :b, :], layer.values[..., :b, :]]
    return out


def sliced_layers(cache, b: int) -> list:
    """Copies of `cache`'s layers holding K/V of positions [0, b) as contiguous tensors, as a
    [0, b) forward from an empty cache leaves them (torch.cat's fresh contiguous result)."""
    out = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.keys = layer.keys[..., :b, :].contiguous()  # [N, H, b, D]
        new.values = layer.values[..., :b, :].contiguous()
        out.append(new)
    return out


def run_longest(lm, ids, first_scored: int, end: int, leaf: bool, forward):
    """(logits, cache, source) of the root segment [0, end), run with a cache so that shorter
    siblings can be cut from it: `cache` is what its later segments extend (None for a leaf),
    `source` the cache to cut from (None: cut nothing). A leaf ran without a cache before: its
    logits with one are used only once they equal those without, for this shape."""
    keep = max(0, end - first_scored)
    key = _key(lm, "leaf-with-cache", ids.shape[0], end, keep)
    verdict = lm.prefix_verdicts.get(key) if leaf else True
    if verdict is False:
        return forward(lm, ids[:, :end], None, keep), None, None
    cache = new_dynamic_cache(lm.model)
    logits = forward(lm, ids[:, :end], cache, keep)
    if not applies(lm, cache):
        if not leaf:
            return logits, cache, None
        lm.prefix_verdicts[key] = False
        return forward(lm, ids[:, :end], None, keep), None, None
    if verdict is None:
        plain = forward(lm, ids[:, :end], None, keep)
        verdict = lm.prefix_verdicts[key] = bitwise_equal([plain], [logits])
        STATS["verified"] += 1
        STATS["failed"] += not verdict
        return plain, None, (cache if verdict else None)
    return logits, (None if leaf else cache), cache


def run_cut(lm, ids, first_scored: int, b: int, end: int, long_logits, source, cache_out, forward):
    """Logits of root segment [0, b) (None when none are scored), its K/V put in `cache_out` (a
    fresh cache, or None for a leaf), taken from the longer [0, end) forward (`source`, its cache;
    None: run [0, b) as before) where this shape's verdict is True; the first time, verified: both
    compared, and the separate forward's outputs used."""
    keep_b, keep = max(0, b - first_scored), max(0, end - first_scored)
    key = _key(lm, "cut", ids.shape[0], b, end, keep_b, keep)
    verdict = lm.prefix_verdicts.get(key) if source is not None else False
    cut_logits = long_logits[:, :keep_b].contiguous() if keep_b else None  # positions first_scored .. b-1
    if verdict:
        STATS["reused"] += 1
        if cache_out is not None:
            cache_out.layers = sliced_layers(source, b)
        return cut_logits
    own = cache_out if cache_out is not None or verdict is False else new_dynamic_cache(lm.model)
    logits = forward(lm, ids[:, :b], own, keep_b)
    if verdict is None:
        same = applies(lm, own) and bitwise_equal(_kv(own), _kv(source, b))
        if keep_b:
            same = same and bitwise_equal([logits], [cut_logits])
        lm.prefix_verdicts[key] = same
        STATS["verified"] += 1
        STATS["failed"] += not same
    return logits
