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


# The one pair most explain tests judge: A = [5, 6, 7, 8], B = [5, 6, 9, 8], a near-tie at t = 2.
A_TOK, B_TOK = [5, 6, 7, 8], [5, 6, 9, 8]
NEAR_A = {2: (7, 9, -0.70, -0.72)}  # at t = 2, A's token 0.02 nats above B's
NEAR_B = {2: (9, 7, -0.70, -0.71)}
PAIR = {
    "key": "p",
    "class": "bf16_tie_flip",
    "position": 2,
    "token_a": 7,
    "token_b": 9,
    "boundary_a": 0,
    "boundary_b": 32,
}


def ab_traces(tmp_path):
    """(A, B): the pair's two HTTP traces (A cold, B at a reused prefix of 32)."""
    a = write(tmp_path / "a.h5", [(record("p", cached=0), columns(A_TOK, near=NEAR_A))])
    b = write(tmp_path / "b.h5", [(record("p", cached=32), columns(B_TOK, near=NEAR_B))])
    return a, b


def as_a(n):
    """Variant rows that give A's token at t."""
    return dict(token_seqs=[[5, 6, 7]] * n, near=NEAR_A)


def as_b(n):
    """Variant rows that give B's token at t."""
    return dict(token_seqs=[[5, 6, 9]] * n, near=NEAR_B)


def fp32_full(tmp_path):
    """The FP32 full-history replay of A's tokens up to t (the reference)."""
    rows = [(record("p", history="full", dtype="fp32"), columns([5, 6, 7], near=NEAR_A, logits=True))]
    return write(tmp_path / "teacher.h5", rows, source="teacher_forced", raw=True)


def flip_calibration(max_gap_nats: float, flips: int = 3):
    """A healthy engine's calibration whose flips (`flips` of them) sit in the bin of max_gap_nats."""
    from tracekit.calibration import NATS_EDGES, Calibration, GapBins

    n = len(NATS_EDGES) - 1
    fl = tuple(flips if NATS_EDGES[i] <= max_gap_nats < NATS_EDGES[i + 1] else 0 for i in range(n))
    return Calibration(
        "healthy-repeats", "bf16", {}, 40, GapBins("nats", NATS_EDGES, (100,) * n, fl), None,
        {"p100": 0.05}, {"p100": 0.01}, max_gap_nats, None,
    )  # fmt: skip
