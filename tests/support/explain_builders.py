"""Hand-built traces for the explain tests, written through the real store: an HTTP
trace of A/B rows, a variant trace whose rows carry `params.explain` tags as
capture/explain writes them, and a teacher-forced trace. Every position gets a
top-k row: the chosen id first, then `other` ids far below; `near` puts the
pair's two tokens next to each other (a near-tie) at the flip position."""

from __future__ import annotations

import json

import numpy as np

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceWriter

PROMPT = (11, 12, 13, 14)


def columns(tokens, lps=None, near: dict | None = None, k: int = 5, logits: bool = False) -> TokenColumns:
    """near: {position: (first_id, second_id, lp_first, lp_second)} for the top-2 at that position."""
    n = len(tokens)
    lps = np.full(n, -0.01) if lps is None else np.asarray(lps, np.float64)
    ids = np.full((n, k), -1, np.int32)
    top = np.full((n, k), np.nan, np.float32)
    for t, tok in enumerate(tokens):
        row = [(tok, lps[t])] + [(1000 + i, -6.0 - i) for i in range(1, k)]
        if near and t in near:
            a, b, la, lb = near[t]
            row = [(a, la), (b, lb)] + [(1000 + i, -6.0 - i) for i in range(1, k - 1)]
        for j, (i, lp) in enumerate(row[:k]):
            ids[t, j], top[t, j] = i, lp
    lg = top * 4.0 if logits else None  # any order-preserving values: the top-1 is what counts
    return TokenColumns(np.asarray(tokens, np.int32), lps, np.arange(n, dtype=np.float64), ids, top, lg)


def write(path, rows: list[tuple[RequestRecord, TokenColumns]], source="http", run=None, raw=False, k=5) -> str:
    meta = RunMeta(source=source, run=dict(run or {"dtype": "bf16"}), layout=Layout(topk=k, raw_logits=raw))
    with TraceWriter(path, meta) as w:
        for rec, cols in rows:
            w.append(rec, cols, list(PROMPT), flush=False)
        w.flush()
    return str(path)


def record(key: str, cached: int = -1, status: str = "ok", params: dict | None = None, **kw) -> RequestRecord:
    return RequestRecord(
        key=key,
        prompt_hash=prompt_hash(list(PROMPT)),
        status=status,
        cached_tokens=cached,
        prompt_len=len(PROMPT),
        params=json.dumps(params or {}),
        **kw,
    )


def run(target: str, variant: str, r: int, tokens, lps=None, near=None, cached=-1, config="engine", status="ok"):
    """One variant run of `target` (a row as capture/explain writes it)."""
    tag = {"target": target, "variant": variant, "role": "target", "repeat": r, "config": config}
    return record(f"{target}@{variant}#r{r}", cached, status, {"explain": tag}), columns(tokens, lps, near)


def runs(target: str, variant: str, token_seqs, **kw):
    return [run(target, variant, r, toks, **kw) for r, toks in enumerate(token_seqs)]
