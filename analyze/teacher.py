"""The --teacher-forced cross-check: does some cache history or dtype of a
teacher-forced diagnostic reproduce an HTTP flip at the same position?

The diagnostic (capture/, source "teacher_forced") replays a request's tokens
through the model under several (history, dtype) configurations and stores one
row per (key, history, dtype), with the same key as the HTTP request. At the
first divergent position t of a pair, for each configuration c of that key whose
replayed tokens before t equal A's (so its position t sees the same prefix):

    argmax_c(t) = the top-k id with the largest raw logit (logprob without logits)
    c flips     iff argmax_c(t) == B's token, or c's history is not `full` and
                argmax_c(t) != argmax_(full, same dtype)(t)

The verdict lists the flipping configurations, non-full histories first, with
how many configurations pick each token ("reproduced by prefix:8 bf16 (1/4 pick
B's token, 3/4 A's)"), or says "not reproduced (N configurations)". It is evidence next to the
class, never a replacement for it: the class always comes from the HTTP traces.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tracekit.store import TraceReader, read_token_rows

from .align import Alignment, top1


def _argmax_ids(reader: TraceReader, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] the top-1 id at each token row, by raw logit when stored."""
    logits = read_token_rows(reader, "topk_logit", rows) if reader.has_column("topk_logit") else None
    ids, _ = top1(read_token_rows(reader, "topk_id", rows), read_token_rows(reader, "topk_logprob", rows), logits)
    return ids.astype(np.int64)


def cross_check(diag: TraceReader, al: Alignment, cols: dict[str, np.ndarray]) -> np.ndarray:
    """[P] verdict per pair: a string for pairs that diverge inside the compared
    length, None for the others."""
    P = len(al.keys)
    out = np.full(P, None, dtype=object)
    t_all = cols["position"]
    div = np.flatnonzero((t_all >= 0) & (t_all < cols["compared"]))
    tab = diag.requests
    by_key: dict[str, list[int]] = defaultdict(list)
    for r, (k, st) in enumerate(zip(tab.key.tolist(), tab.status.tolist())):
        if st == "ok":
            by_key[k].append(r)
    d_tok = diag.column("token_id")
    # Pass 1: which (pair, diag row) combinations are usable; pass 2 reads their rows at t in one go.
    jobs: list[tuple[int, int]] = []
    for i in div.tolist():
        rows = by_key.get(al.keys[i], [])
        if not rows:
            out[i] = "no diagnostic row for this key"
            continue
        t = int(t_all[i])
        a_prefix = al.a.token_id[al.off_a[i] : al.off_a[i] + t]
        usable = [
            r
            for r in rows
            if tab.n_tokens[r] > t and np.array_equal(d_tok[tab.token_offset[r] : tab.token_offset[r] + t], a_prefix)
        ]
        if not usable:
            out[i] = "not comparable (the diagnostic replays other tokens or is shorter)"
        jobs += [(i, r) for r in usable]
    if not jobs:
        return out
    pair_of = np.array([j[0] for j in jobs])
    drow = np.array([j[1] for j in jobs])
    am = _argmax_ids(diag, tab.token_offset[drow] + t_all[pair_of])
    for i in np.unique(pair_of).tolist():
        sel = np.flatnonzero(pair_of == i)
        conf = {(tab.history[drow[j]], tab.dtype[drow[j]]): int(am[j]) for j in sel}
        out[i] = _verdict(conf, int(cols["token_a"][i]), int(cols["token_b"][i]))
    return out


def _verdict(conf: dict[tuple[str, str], int], token_a: int, token_b: int) -> str:
    to_b = [c for c, a in conf.items() if a == token_b]
    vs_full = [
        c
        for c, a in conf.items()
        if c[0] != "full" and ("full", c[1]) in conf and a != conf[("full", c[1])] and c not in to_b
    ]
    n = len(conf)
    if not to_b and not vs_full:
        return f"not reproduced ({n} configuration{'s' if n != 1 else ''})"
    # Non-full histories first: "prefix:8 bf16" says more than "full fp32".
    flips = sorted(to_b + vs_full, key=lambda c: c[0] == "full")
    names = ", ".join(f"{h} {d}".strip() for h, d in flips[:4]) + (" …" if len(flips) > 4 else "")
    n_a = sum(a == token_a for a in conf.values())
    return f"reproduced by {names} ({len(to_b)}/{n} pick B's token, {n_a}/{n} A's){_fp32_side(conf, token_a, token_b)}"


def _fp32_side(conf: dict[tuple[str, str], int], token_a: int, token_b: int) -> str:
    """Which side the FP32 full-history argmax (the nearest thing to ground truth) agrees with:
    when it is B's token, A is the run that rounded away, not B."""
    ref = conf.get(("full", "fp32"))
    if ref is None:
        return ""
    if ref == token_b:
        return "; FP32 full history picks B's token: A is the side that rounded away from it"
    if ref == token_a:
        return "; FP32 full history picks A's token"
    return f"; FP32 full history picks neither ({ref})"
