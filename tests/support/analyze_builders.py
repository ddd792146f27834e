"""Hand-built traces with known contents, written through the real store API.

A request is given as its chosen token ids; each position gets a default
top-k row (the chosen id first with logprob -0.01 / logit 10, then filler ids
1000+i far below it) unless `rows` overrides position t with explicit
(id, logprob[, logit]) candidates. Filler ids never collide with real ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceWriter

EOS = 2


@dataclass
class Req:
    key: str
    tokens: list[int]
    rows: dict[int, list[tuple]] = field(default_factory=dict)  # position -> [(id, lp[, logit])]
    lp: dict[int, float] = field(default_factory=dict)  # position -> chosen logprob override
    cached: int = -1
    prompt: tuple[int, ...] | None = (11, 12, 13, 14)
    status: str = "ok"
    finish: str = "length"
    history: str = ""
    dtype: str = ""
    phash: str | None = None
    params: dict | None = None  # the request body as capture records it (temperature, max_tokens, ...)


def _columns(r: Req, k: int, raw: bool) -> TokenColumns:
    n = len(r.tokens)
    ids = np.full((n, k), -1, np.int32)
    lps = np.full((n, k), np.nan, np.float32)
    lgs = np.full((n, k), np.nan, np.float32)
    chosen = np.zeros(n, np.float32)
    for t, tok in enumerate(r.tokens):
        cand = r.rows.get(t) or [(tok, r.lp.get(t, -0.01), 10.0)] + [(1000 + i, -5.0 - i, 5.0 - i) for i in range(1, k)]
        for j, c in enumerate(cand[:k]):
            ids[t, j], lps[t, j] = c[0], c[1]
            lgs[t, j] = c[2] if len(c) > 2 else np.nan
        mine = [c for c in cand if c[0] == tok]
        chosen[t] = mine[0][1] if mine else r.lp.get(t, -0.01)
    return TokenColumns(
        np.array(r.tokens, np.int32), chosen, np.arange(n, dtype=np.float64), ids, lps, lgs if raw else None
    )


def write_trace(
    path,
    reqs: list[Req],
    k: int = 5,
    raw: bool = False,
    eos: tuple[int, ...] | None = (EOS,),
    source: str = "http",
    run: dict | None = None,
) -> str:
    run = dict(run or {})
    if eos is not None:
        run["eos_token_ids"] = list(eos)
    meta = RunMeta(source=source, run=run, layout=Layout(topk=k, raw_logits=raw))
    items = []
    for r in reqs:
        ph = r.phash if r.phash is not None else prompt_hash(list(r.prompt or ()))
        rec = RequestRecord(
            key=r.key,
            prompt_hash=ph,
            status=r.status,
            finish_reason=r.finish,
            cached_tokens=r.cached,
            history=r.history,
            dtype=r.dtype,
            http_status=200 if r.status == "ok" else 500,
            error="" if r.status == "ok" else "boom",
            params=json.dumps(r.params) if r.params is not None else "",
        )
        items.append((rec, _columns(r, k, raw), r.prompt))
    # One group commit, chunks sized to the content (no repack at close), no journal:
    # thousands of hand-built traces in the property tests stay fast.
    with TraceWriter(path, meta, expected_tokens=sum(len(r.tokens) for r in reqs) or 1, journal=False) as w:
        w.append_many(items)
    return str(path)


def flip(
    a_tok: int, b_tok: int, lp_a: float, lp_b: float, logit_a: float | None = None, logit_b: float | None = None
) -> list[tuple]:
    """A top-k row holding both candidates (a_tok first), then filler."""
    first = (a_tok, lp_a) if logit_a is None else (a_tok, lp_a, logit_a)
    second = (b_tok, lp_b) if logit_b is None else (b_tok, lp_b, logit_b)
    return [first, second] + [(1000 + i, -6.0 - i, 1.0 - i) for i in range(1, 8)]


def logit_row(cands: list[tuple[int, float]], filler: tuple[float, ...] = (4.0, 3.0, 2.0)) -> list[tuple]:
    """A top-k row from raw logits: (id, logprob, logit) with logprobs the log-softmax
    over the candidates plus filler ids 1000+ (so logits and logprobs tell the same gaps)."""
    vals = [x for _, x in cands] + list(filler)
    m = max(vals)
    z = m + math.log(sum(math.exp(v - m) for v in vals))
    out = [(i, x - z, x) for i, x in cands] + [(1000 + j, x - z, x) for j, x in enumerate(filler)]
    return sorted(out, key=lambda c: -c[2])
