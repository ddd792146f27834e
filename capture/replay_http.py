"""`tracekit capture --replay-http URL --from run.h5`: the engine's own logits for the traced tokens.

For every traced sequence (prompt ids + the tokens a live run generated) and every asked history,
the engine under test is asked for its own logprobs (and top-k, and raw logits where it gives
them) of exactly those tokens, with its cache history under control:

- `cold`: the cache emptied (or bypassed) first; proven by the engine's report (`cached_tokens` 0)
  where it reports one, else by what its source says (named in the row's params);
- `warm:B` / `warm:auto`: the cache emptied, primed with the prompt's first B tokens (auto: the
  live row's own `cached_tokens`), then the replay; the row records the boundary the engine says
  it reused, and its label names that boundary, never the asked one when they differ.

Rows land in a normal teacher-forced trace (source `teacher_forced`, one row per key x history,
history `engine:cold` / `engine:warm:B`, dtype the engine's), so `diff --b-select`, `show` and
`explain` read them as the HF diagnostic's rows. Each engine's way (replay_engines.py) says what
it cannot do; a history it cannot achieve is refused with one line, never computed some other way.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from tracekit.errors import ConfigError
from tracekit.runinfo import base_run
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns

from .replay_engines import ENGINES, Replayed, Unsupported, engine_for
from .teacher.sequences import TokenSequence, from_trace


@dataclass(frozen=True)
class ReplayHistory:
    kind: str  # cold | warm
    boundary: int | None = None  # warm: B; None = auto (the live row's cached_tokens)

    @property
    def asked(self) -> str:
        return "cold" if self.kind == "cold" else f"warm:{'auto' if self.boundary is None else self.boundary}"

    def resolve(self, seq: TokenSequence) -> tuple[int | None, str]:
        """(the boundary to prime, 0 = cold; None when it does not apply) and why not."""
        if self.kind == "cold":
            return 0, ""
        b = seq.cached_tokens if self.boundary is None else self.boundary
        if self.boundary is None and b < 0:
            return None, "the live row reports no cached_tokens (-1); give warm:B"
        if b == 0:
            return None, "the live row reused nothing (cached_tokens 0): that history is `cold`"
        if b >= len(seq.prompt_ids):
            return None, f"boundary {b} is not inside the {len(seq.prompt_ids)}-token prompt"
        return b, ""


def parse_histories(text: str | list[str] | tuple[str, ...]) -> tuple[ReplayHistory, ...]:
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if not items:
        raise ConfigError("--history is empty: give cold, warm:auto or warm:B (comma-separated)")
    out = []
    for it in items:
        if it == "cold":
            out.append(ReplayHistory("cold"))
        elif it == "warm:auto":
            out.append(ReplayHistory("warm"))
        elif it.startswith("warm:") and it[5:].isdigit() and int(it[5:]) > 0:
            out.append(ReplayHistory("warm", int(it[5:])))
        else:
            raise ConfigError(
                f"bad --history item {it!r} for --replay-http: expected cold, warm:auto or warm:B (B > 0)"
            )
    return tuple(out)


@dataclass(frozen=True)
class ReplayHttpConfig:
    url: str
    source: str  # the live trace (run.h5)
    out: str
    histories: tuple[ReplayHistory, ...] = (ReplayHistory("cold"), ReplayHistory("warm"))
    keys: tuple[str, ...] = ()
    top_logprobs: int = 20
    engine: str = "auto"  # auto | tracekit | vllm | sglang | tgi | llamacpp
    method: str = "auto"  # tracekit: forced (default) | prompt-logprobs
    timeout_s: float = 300.0
    api_key: str | None = None
    tokenizer: str | None = None  # TGI: text in, so the ids are decoded and checked
    histories_by_key: dict | None = None  # key -> its own histories (explain: cold, A's and B's boundary)
    dtype: str | None = None  # the rows' dtype label when the engine reports none (else the source's)


@dataclass
class ReplaySummary:
    out: str
    engine: str
    method: str
    rows: int = 0
    ok: int = 0
    failed: list[str] = field(default_factory=list)  # "key history: why"
    skipped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # "history: why" (the engine cannot)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_replay_http(cfg: ReplayHttpConfig) -> ReplaySummary:
    from tracekit.store import TraceReader

    seqs = from_trace(cfg.source, list(cfg.keys) or None)
    with TraceReader(cfg.source) as r:
        src_run = dict(r.meta.run)
    return asyncio.run(_run(cfg, seqs, src_run))


def replay_sequences(cfg: ReplayHttpConfig, seqs: list[TokenSequence], run: dict | None = None) -> ReplaySummary:
    """The same replay for sequences given here (tracekit explain's targets); `run` holds the run
    metadata fields to keep (model, eos_token_ids, dtype ...)."""
    return asyncio.run(_run(cfg, seqs, dict(run or {})))


async def _run(cfg: ReplayHttpConfig, seqs: list[TokenSequence], src_run: dict) -> ReplaySummary:
    from tracekit.store import TraceWriter

    from .client import make_session
    from .probe import probe

    session = make_session(1, cfg.timeout_s, cfg.api_key)
    async with session:
        pr = await probe(session, cfg.url.rstrip("/"), "auto")
        kind = cfg.engine if cfg.engine != "auto" else pr.engine_kind
        if kind not in ENGINES:
            raise ConfigError(
                f"{cfg.url}: --replay-http knows {', '.join(ENGINES)}; the server looks like {kind!r} "
                "(pass --replay-engine to say which it is)"
            )
        eng = engine_for(kind, cfg, pr)
        eng.dtype = eng.dtype or cfg.dtype or str(src_run.get("dtype") or "")
        summary = ReplaySummary(cfg.out, kind, eng.method)
        usable = []
        asked = list(cfg.histories) + [h for hs in (cfg.histories_by_key or {}).values() for h in hs]
        for h in dict.fromkeys(asked):
            why = eng.refuses(h.kind)
            if why:
                summary.refused.append(f"{h.asked}: {why}")
                print(f"refused: --history {h.asked} on {kind}: {why}", file=sys.stderr)
            else:
                usable.append(h)
        if not usable:
            raise ConfigError(f"{kind} can replay none of the asked histories: " + "; ".join(summary.refused))
        meta = _meta(cfg, src_run, pr, eng)
        with TraceWriter(cfg.out, meta) as w:
            for seq in seqs:
                mine = (cfg.histories_by_key or {}).get(seq.key, cfg.histories)
                for h in [h for h in mine if h in usable]:
                    b, why = h.resolve(seq)
                    if b is None:
                        summary.skipped.append(f"{seq.key} {h.asked} ({why})")
                        continue
                    try:
                        got = await eng.replay(session, seq, b)
                        rec, cols, err = _row(seq, h, b, got, eng, meta.layout)
                    except Unsupported as e:
                        rec, cols, err = _failed(seq, h, str(e), eng), None, str(e)
                    w.append(rec, cols, seq.prompt_ids)
                    summary.rows += 1
                    if err:
                        summary.failed.append(f"{seq.key} {h.asked}: {err}")
                    else:
                        summary.ok += 1
    return summary


def _meta(cfg: ReplayHttpConfig, src_run: dict, pr, eng) -> RunMeta:
    keep = ("model", "tokenizer", "model_dir", "eos_token_ids", "dtype", "dtype_source", "engine_family")
    run = base_run(
        **{k: src_run[k] for k in keep if k in src_run},
        target=cfg.url,
        dialect=f"replay-http:{eng.name}",
        engine=pr.engine,
        histories=sorted(
            {h.asked for h in cfg.histories} | {h.asked for hs in (cfg.histories_by_key or {}).values() for h in hs}
        ),  # fmt: skip
        top_logprobs=cfg.top_logprobs,
        replay_http={
            "from": cfg.source,
            "engine": eng.name,
            "method": eng.method,
            "limits": eng.limits(),
            "refused": {
                h.asked: eng.refuses(h.kind)
                for h in [*cfg.histories, *[h for hs in (cfg.histories_by_key or {}).values() for h in hs]]
                if eng.refuses(h.kind)
            },
        },
    )
    return RunMeta(source="teacher_forced", run=run, layout=Layout(topk=cfg.top_logprobs, raw_logits=eng.raw_logits))


def _label(b_reused: int, asked_b: int) -> str:
    return "engine:cold" if asked_b == 0 else f"engine:warm:{b_reused}"


def _row(seq: TokenSequence, h: ReplayHistory, b: int, got: Replayed, eng, layout: Layout):
    """The trace row of one replay: its columns, and an error when the history was not achieved."""
    err = ""
    reused = got.cached_tokens
    if b == 0 and reused > 0:
        err = f"asked cold, the engine reused {reused} tokens"
    if b > 0 and reused < 0:
        err = "the engine does not report the reused boundary: warm cannot be proven"
    if got.error:
        err = got.error
    label = _label(reused if b > 0 else 0, b)
    params = {
        "teacher_forced": True,
        "replay_http": eng.name,
        "method": eng.method,
        "history_asked": h.asked,
        "boundary_asked": b,
        "cached_tokens_reported": reused,
        "proof": got.proof,
        **got.notes,
    }
    rec = RequestRecord(
        key=seq.key,
        prompt_hash=seq.prompt_hash,
        status="error" if err else "ok",
        error=err,
        finish_reason=seq.finish_reason,
        cached_tokens=reused,
        prompt_len=len(seq.prompt_ids),
        history=label,
        dtype=eng.dtype or "",
        prompt_text=seq.prompt_text,
        params=json.dumps(params, sort_keys=True),
    )
    return rec, _columns(seq, got, layout), err


def _failed(seq: TokenSequence, h: ReplayHistory, why: str, eng) -> RequestRecord:
    return RequestRecord(
        key=seq.key,
        prompt_hash=seq.prompt_hash,
        status="error",
        error=why,
        prompt_len=len(seq.prompt_ids),
        history=f"engine:{h.asked}",
        dtype=eng.dtype or "",
        params=json.dumps({"teacher_forced": True, "replay_http": eng.name, "history_asked": h.asked}),
    )


def _columns(seq: TokenSequence, got: Replayed, layout: Layout) -> TokenColumns:
    g, k = len(seq.gen_ids), layout.topk
    top_id = np.full((g, k), -1, np.int32)
    top_lp = np.full((g, k), np.nan, np.float32)
    top_lg = np.full((g, k), np.nan, np.float32) if layout.raw_logits else None
    for t, row in enumerate(got.top):
        for j, (tid, lp, lg) in enumerate(row[:k]):
            top_id[t, j], top_lp[t, j] = tid, lp
            if top_lg is not None and lg is not None:
                top_lg[t, j] = lg
    lps = np.array([math.nan if v is None else v for v in got.logprobs], np.float32)
    return TokenColumns(np.asarray(seq.gen_ids, np.int32), lps, np.full(g, np.nan), top_id, top_lp, top_lg)
