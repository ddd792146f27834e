"""Run the controlled variants of `tracekit explain` against one live engine.

For each target (a divergent pair) and each repeat r, in this order:

| variant | what is sent |
|---|---|
| `alone:cold` | flush the prefix cache (llama.cpp: `cache_prompt: false`), then the prompt alone |
| | (llama.cpp's warm and burst runs send `cache_prompt: true`; its flush erases every slot, |
| | possible only with `--slot-save-path`: without it the runs start from what the slots hold) |
| `alone` | the prompt alone, cache state unknown (instead of `alone:cold` when no flush exists) |
| `warm:<b>` | flush, prime, then the prompt alone: it reuses exactly b tokens. For b = B's boundary, |
| | and A's when it differs and is > 0 |
| `burst` | flush, prime each member at its boundary in B, then the prompt and its batch mates |
| | from B all at once, in B's order |

Priming (`priming`): one token for the prompt with its token b replaced, so the
cache holds the first b tokens computed in a forward of the prompt's length.

Every request, primes and mates included, is a row of one trace (the normal
`TraceWriter`: journal first, flushed after each group, so a SIGKILL keeps every
finished group). A row's `params` JSON carries an `explain` object saying what
it is: `{target, variant, role: target|mate|prime, repeat, config}`; keys read
`p00@warm:112#r3`, `p03@burst[p00]#r3`, primes `p00@warm:112/prime:112#r3`,
`p03@burst[p00]/prime:96#r3`. Sending goes
through `tracekit.capture.client.send` (one request -> `Outcome`), the probe through
`tracekit.capture.probe`, exactly as `tracekit capture` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from dataclasses import dataclass, field

from tracekit.errors import ConfigError
from tracekit.runinfo import base_run
from tracekit.schema import Layout, RunMeta
from tracekit.store import TraceWriter
from tracekit.variants import ALONE, BURST, COLD, Variant

from .. import dialects
from ..client import Clock, Outcome, finish, make_session, send
from ..dialects import RequestSpec
from ..probe import probe
from .cache import CacheControl, detect, post_flush
from .plan import Target

CONFIGS = ("engine", "deterministic", "fp32")


@dataclass(frozen=True)
class VariantConfig:
    url: str
    out: str
    config: str = "engine"  # which configuration of the target this URL serves: engine | deterministic | fp32
    repeats: int = 5
    top_logprobs: int = 5
    timeout_s: float = 600.0
    dialect: str = "auto"
    api_key_env: str | None = None
    run_meta: dict = field(default_factory=dict)


@dataclass
class VariantSummary:
    out: str
    config: str
    rows: int = 0
    counts: dict = field(default_factory=lambda: {"ok": 0, "error": 0, "cancelled": 0, "timeout": 0})
    cache: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def tag_of(params: str) -> dict | None:
    """The `explain` object of a row's params JSON, or None for rows that are not variants."""
    try:
        tag = json.loads(params).get("explain") if params else None
    except (ValueError, AttributeError):
        return None
    return tag if isinstance(tag, dict) else None


class _Sender:
    """One run's session, dialect, cache control and writer; sends groups and writes them."""

    def __init__(self, session, base, pr, cache: CacheControl, writer: TraceWriter, cfg: VariantConfig, summary):
        self.session, self.base, self.pr, self.cache, self.writer = session, base, pr, cache, writer
        self.cfg, self.summary = cfg, summary
        self.dialect = dialects.get(pr.dialect)
        self.clock = Clock()

    def spec(self, key: str, prompt, max_tokens: int, ignore_eos: bool, cold: bool = False) -> RequestSpec:
        extra = {**self.pr.extra_body, **(self.cache.cold_body if cold else self.cache.warm_body)}
        return RequestSpec(
            key=key,
            prompt=list(prompt),
            max_tokens=max_tokens,
            top_logprobs=self.cfg.top_logprobs,
            ignore_eos=ignore_eos,
            stream=True,
            model=self.pr.model,
            extra=extra,
        )

    async def flush(self) -> None:
        for route in self.cache.routes():
            ok, what = await post_flush(self.session, self.base, route)
            if not ok and len(self.summary.notes) < 20:
                self.summary.notes.append(f"flush failed during the run: {what}")

    async def group(self, specs: list[RequestSpec], tags: list[dict]) -> list[Outcome]:
        """Send specs at once; write every outcome (one group commit) tagged with what it is."""
        raw, k = self.writer.layout.raw_logits, self.cfg.top_logprobs
        sent = await asyncio.gather(*(send(self.session, self.base, self.dialect, s, self.clock) for s in specs))
        outs = []
        for (outcome, acc), tag in zip(sent, tags):
            o = finish(outcome, acc, k, raw, None)
            params = json.loads(o.record.params) if o.record.params else {}
            params["explain"] = {**tag, "config": self.cfg.config}
            rec = dataclasses.replace(o.record, params=json.dumps(params, sort_keys=True))
            outs.append(Outcome(rec, o.tokens, o.prompt_ids))
            self.summary.counts[rec.status] += 1
        self.writer.append_many([(o.record, o.tokens, o.prompt_ids) for o in outs])
        self.summary.rows += len(outs)
        return outs

    async def prime(self, tg: Target, prompt, b: int, r: int, variant: str, owner: str) -> None:
        """Leave `prompt[:b]` in the prefix cache, computed as the serial run computed it (see priming)."""
        tag = {"target": tg.key, "variant": variant, "role": "prime", "repeat": r, "for": owner, "boundary": b}
        where = variant if owner == tg.key else f"{variant}[{tg.key}]"
        await self.group([self.spec(f"{owner}@{where}/prime:{b}#r{r}", priming(prompt, b), 1, True)], [tag])


def priming(prompt, b: int) -> list[int]:
    """The prompt with token b replaced: a request whose first b tokens equal the prompt's and
    whose block holding position b does not, so the prompt sent next reuses exactly b tokens
    (b is block-aligned: it is a boundary an engine reported). Same length as the prompt, so
    the cached prefix's KV comes from a forward of the prompt's own length, as in the run that
    cached it (in BF16 a prefix computed in a shorter forward can round differently)."""
    p = list(prompt)
    other = next((t for t in p if t != p[b]), None)
    if other is None:  # a prompt of one repeated id: a prefix-only prime is the best left
        return p[:b]
    p[b] = other
    return p


async def _alone(s: _Sender, tg: Target, r: int) -> None:
    variant = str(COLD if s.cache.available else ALONE)
    await s.flush()
    spec = s.spec(f"{tg.key}@{variant}#r{r}", tg.prompt, tg.max_tokens, tg.ignore_eos, cold=True)
    await s.group([spec], [{"target": tg.key, "variant": variant, "role": "target", "repeat": r}])


def warm_boundaries(tg: Target) -> list[int]:
    """B's boundary, then A's when it differs; only reused prefixes (> 0) shorter than the prompt."""
    out = []
    for b in (tg.boundary_b, tg.boundary_a):
        if 0 < b < len(tg.prompt) and b not in out:
            out.append(b)
    return out


async def _warm(s: _Sender, tg: Target, b: int, r: int) -> None:
    await s.flush()
    warm = str(Variant("warm", b))
    await s.prime(tg, tg.prompt, b, r, warm, tg.key)
    spec = s.spec(f"{tg.key}@warm:{b}#r{r}", tg.prompt, tg.max_tokens, tg.ignore_eos)
    await s.group([spec], [{"target": tg.key, "variant": warm, "role": "target", "repeat": r}])


async def _burst(s: _Sender, tg: Target, r: int) -> None:
    await s.flush()
    primed = set()
    for key, prompt, b in [(tg.key, tg.prompt, tg.boundary_b)] + [(m.key, m.prompt, m.boundary) for m in tg.mates]:
        if 0 < b < len(prompt) and tuple(prompt[:b]) not in primed:
            primed.add(tuple(prompt[:b]))
            await s.prime(tg, prompt, b, r, str(BURST), key)
    specs = [s.spec(f"{tg.key}@burst#r{r}", tg.prompt, tg.max_tokens, tg.ignore_eos)]
    tags = [{"target": tg.key, **BURST.to_params(), "role": "target", "repeat": r}]
    for m in tg.mates:
        specs.append(s.spec(f"{m.key}@burst[{tg.key}]#r{r}", m.prompt, max(m.max_tokens, tg.max_tokens), tg.ignore_eos))
        tags.append({"target": tg.key, **BURST.to_params(), "role": "mate", "repeat": r, "mate": m.key})
    # Sent in B's order (requests start in list order), all at once.
    rank = tg.order or tuple(range(len(specs)))
    order = sorted(range(len(specs)), key=lambda i: rank[i])
    await s.group([specs[i] for i in order], [tags[i] for i in order])


def run_variants(cfg: VariantConfig, targets: list[Target]) -> VariantSummary:
    """Every variant of every target against cfg.url, into the trace cfg.out (blocking)."""
    if cfg.config not in CONFIGS:
        raise ConfigError(f"variant config {cfg.config!r}: expected one of {', '.join(CONFIGS)}")
    if cfg.repeats < 1 or cfg.top_logprobs < 2:
        raise ConfigError("--repeats must be >= 1 and the top-k width >= 2 (the gap at the flip needs two tokens)")
    if not targets:
        raise ConfigError("no divergent pair to explain")
    if os.path.exists(cfg.out):
        raise ConfigError(f"{cfg.out}: already exists; choose another --out directory")
    return asyncio.run(_run(cfg, targets))


async def _run(cfg: VariantConfig, targets: list[Target]) -> VariantSummary:
    base = cfg.url.rstrip("/")
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if cfg.api_key_env and not key:
        raise ConfigError(f"--api-key-env {cfg.api_key_env}: the environment variable is not set or empty")
    width = max(1 + len(t.mates) for t in targets)
    summary = VariantSummary(cfg.out, cfg.config)
    async with make_session(width, cfg.timeout_s, key) as session:
        pr = await probe(session, base, cfg.dialect)
        cache = await detect(session, base, pr.dialect, pr.engine)
        summary.cache = cache.as_dict()
        run = base_run(
            target=cfg.url,
            dialect=pr.dialect,
            dialect_reason=pr.reason,
            engine=pr.engine,
            model=pr.model,
            eos_token_ids=pr.eos_token_ids,
            sampling={"temperature": 0.0, "top_logprobs": cfg.top_logprobs, "stream": True},
            explain={"config": cfg.config, "repeats": cfg.repeats, "cache_flush": cache.as_dict()},
            **cfg.run_meta,
        )
        meta = RunMeta(source="http", run=run, layout=Layout(topk=cfg.top_logprobs, raw_logits=pr.raw_logits))
        hint = sum(cfg.repeats * (4 + len(t.mates)) * (t.max_tokens + 1) for t in targets)
        with TraceWriter(cfg.out, meta, expected_tokens=hint) as writer:
            s = _Sender(session, base, pr, cache, writer, cfg, summary)
            for tg in targets:
                for r in range(cfg.repeats):
                    await _alone(s, tg, r)
                    for b in warm_boundaries(tg):
                        await _warm(s, tg, b, r)
                    if tg.mates:
                        await _burst(s, tg, r)
    if not cache.available:
        summary.notes.insert(0, f"cold variant unavailable on {cfg.url}: {cache.reason}")
    return summary
