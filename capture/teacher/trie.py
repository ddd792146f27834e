"""Run the histories of a batch of equal-shape sequences through an HF causal LM.

Histories are executed as a trie of segments: two histories whose first j
segment ends are equal run those j forwards once (same token slices, same
shapes, same cache contents, so the same numbers) and fork the KV cache where
they part. One more sharing, only where verified bitwise: a first segment
tokens[:b] is cut from a sibling's longer first segment tokens[:S] on the
shapes where the two forwards were compared and found equal (reuse.py;
different shapes can pick different kernels, so nothing is assumed). Nothing
else is shared: one dtype never feeds another, and sequences of different
lengths are never padded into one batch (padding changes the attention
numerics).

This module knows nothing about files, prompts or tokenizers; torch and
transformers are imported lazily.
"""

from __future__ import annotations

from typing import Any

from tracekit.hfcompat import new_dynamic_cache

from . import chain, reuse
from .graphs import MIN_STEPS, NoGraph, decode_chain, graphable
from .history import History
from .model import fork_cache
from .records import LoadedModel


def _forward(lm: LoadedModel, ids, cache, keep: int):
    """Logits [N, keep, V] (model dtype) of the last `keep` positions of ids [N, S].

    keep == 0 still computes one position (transformers reads 0 as "all").
    """
    kwargs = {"use_cache": cache is not None, "logits_to_keep": max(keep, 1)}
    if cache is not None:
        kwargs[lm.cache_kw] = cache
    logits = lm.model(input_ids=ids, **kwargs).logits
    return logits[:, logits.shape[1] - keep :, :] if keep else None


def run_histories(lm: LoadedModel, ids, first_scored: int, histories: list[History]) -> dict[str, Any]:
    """Logits [N, G, V] (model dtype) at positions first_scored.. of each history.

    ids: [N, n_inputs] long tensor on the model's device; every history's last
    segment end must be n_inputs. Returns {history label: logits}. Nothing
    here reads a device value back to the host: the forwards queue up
    asynchronously and the caller's scoring is the first sync.
    """
    import torch

    pieces: dict[str, list] = {h.label: [] for h in histories}
    # Trie nodes still to run: (histories, depth, start, cache). A stack, not
    # recursion: `decode` over G tokens is a chain G segments deep.
    todo = [(list(histories), 0, 0, None)]
    with torch.inference_mode():
        while todo:
            todo.extend(reversed(_run_node(lm, ids, first_scored, *todo.pop(), pieces)))
    return {label: torch.cat(p, dim=1) if len(p) > 1 else p[0] for label, p in pieces.items()}


def _decode_chain(lm, ids, first_scored, hists, depth, start, cache):
    """When every history left at this node continues with the same run of
    scored single-token steps to the end (the rest of `decode`), run that
    chain as CUDA graphs (graphs.py) or, on CPU, over a preallocated cache
    (chain.py), both the same logits as eager steps, and return its logits
    [N, steps, V]; otherwise None (run eagerly)."""
    if cache is None or start < first_scored:
        return None
    rest = hists[0].ends[depth:]
    if (
        len(rest) < MIN_STEPS
        or rest != tuple(range(start + 1, start + 1 + len(rest)))
        or any(h.ends[depth:] != rest for h in hists)
    ):
        return None
    if lm.cuda_graphs and graphable(lm, cache):
        try:
            return decode_chain(lm, ids[:, : rest[-1]], start, cache)
        except NoGraph:
            return None
    if chain.applies(lm, cache):
        return chain.preallocated_chain(lm, ids[:, : rest[-1]], start, cache, _forward)
    return None


def _run_node(lm, ids, first_scored, hists, depth, start, cache, pieces) -> list[tuple]:
    """Run the forwards of the trie node reached by `depth` shared segments
    ending at `start`; return its children that continue.

    Children are the distinct next segment ends; each runs once for all the
    histories that take it. All but the last child get a forked cache (taken
    before the last child's forward extends `cache`).
    """
    chain = _decode_chain(lm, ids, first_scored, hists, depth, start, cache)
    if chain is not None:
        for h in hists:
            pieces[h.label].append(chain)
        return []
    children: dict[int, list[History]] = {}
    for h in hists:
        children.setdefault(h.ends[depth], []).append(h)
    # At the root every child runs from an empty cache: the shorter ones may be cut from the longest.
    cut = cache is None and lm.reuse_prefixes and len(children) > 1
    if cut:
        longest = max(children)
        leaf = all(len(h.ends) == depth + 1 for h in children[longest])
        long_logits, long_cache, source = reuse.run_longest(lm, ids, first_scored, longest, leaf, _forward)
    out = []
    for i, (end, group) in enumerate(children.items()):
        rest = [h for h in group if len(h.ends) > depth + 1]
        last = i == len(children) - 1
        if cut and end == longest:
            logits, child_cache = long_logits, long_cache
        else:
            if rest:
                child_cache = new_dynamic_cache(lm.model) if cache is None else (cache if last else fork_cache(cache))
            else:
                # A leaf: no later segment reads this cache, but a segment after a
                # prefix must still attend to it (a fork, so siblings see the prefix only).
                child_cache = None if cache is None else (cache if last else fork_cache(cache))
            if cut:
                logits = reuse.run_cut(lm, ids, first_scored, end, longest, long_logits, source, child_cache, _forward)
            else:
                keep = max(0, end - max(start, first_scored))
                logits = _forward(lm, ids[:, start:end], child_cache, keep)
        if logits is not None:
            for h in group:
                pieces[h.label].append(logits)
        if rest:
            out.append((rest, depth + 1, end, child_cache))
    return out
