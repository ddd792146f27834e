"""`tracekit capture --http URL`: the run loop.

Plan the requests (prompt set x repeats, minus what `--resume` keeps), probe
the server, create the trace, then send with at most `concurrency` requests in
flight, arriving as a burst or a Poisson process. Each completed request is
appended to the trace and flushed at once, so a killed capture keeps every
finished request. Failed requests are rows too; the run goes on and the exit
code says whether any failed. Progress goes to stderr (only on a terminal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracekit.errors import ConfigError
from tracekit.runinfo import base_run
from tracekit.schema import Layout, RequestRecord, RunMeta, prompt_hash
from tracekit.store import TraceReader, TraceWriter, copy_requests

from . import dialects
from .client import Clock, Outcome, finish, make_session, send
from .dialects import RequestSpec
from .probe import probe
from .prompts import Prompt, load_prompts
from .tokens import TokenMapper

# Where each dialect's cached-prompt count comes from (recorded in the run metadata).
_USAGE_CACHED = "usage.prompt_tokens_details.cached_tokens"
CACHE_FIELD = {
    "openai": _USAGE_CACHED,
    "openai-chat": _USAGE_CACHED,
    "vllm": _USAGE_CACHED + " (only with --enable-prompt-tokens-details)",
    "sglang": "meta_info.cached_tokens",
    "tgi": "not reported",
    "llamacpp": "timings.cache_n",
}


@dataclass(frozen=True)
class CaptureConfig:
    url: str
    prompts: str
    out: str
    concurrency: int = 1
    max_tokens: int = 32
    top_logprobs: int = 20
    ignore_eos: bool = False
    stream: bool = True
    dialect: str = "auto"
    tokenizer: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 600.0
    arrival: str = "burst"
    repeat: int = 1
    resume: bool = False
    model: str = ""
    seed: int = 0
    run_meta: dict = field(default_factory=dict)
    progress: bool | None = None  # None: only when stderr is a terminal


@dataclass(frozen=True)
class CaptureSummary:
    out: str
    planned: int
    kept: int
    counts: dict
    tokens: int
    wall_s: float
    dialect: str
    latency: dict = field(default_factory=dict)  # ok requests: ttft_s / e2e_s / itl_s -> p50, p90, p99
    failures: list = field(default_factory=list)  # (key, status, error) of the first 20 failed requests

    @property
    def failed(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "ok")

    def as_dict(self) -> dict:
        return {
            "out": self.out,
            "planned": self.planned,
            "kept_from_resume": self.kept,
            "counts": self.counts,
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 3),
            "dialect": self.dialect,
            "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s > 0 else None,
            "latency": self.latency,
            "failures": [list(f) for f in self.failures],
        }


def _percentiles(samples: dict[str, list]) -> dict:
    """{name: [seconds]} -> {name: {p50, p90, p99}} (names with no samples are left out)."""
    out = {}
    for name, xs in samples.items():
        a = np.concatenate([np.atleast_1d(np.asarray(x, np.float64)) for x in xs]) if xs else np.zeros(0)
        a = a[np.isfinite(a)]
        if len(a):
            out[name] = {f"p{q}": round(float(np.percentile(a, q)), 6) for q in (50, 90, 99)}
    return out


def parse_arrival(arrival: str) -> float | None:
    """'burst' -> None; 'poisson:RATE' -> RATE requests/s."""
    if arrival == "burst":
        return None
    name, _, rate = arrival.partition(":")
    try:
        r = float(rate)
    except ValueError:
        r = -1.0
    if name != "poisson" or r <= 0:
        raise ConfigError(f"--arrival {arrival!r}: use 'burst' or 'poisson:RATE' with RATE > 0 requests/s")
    return r


def plan_requests(prompts: list[Prompt], cfg: CaptureConfig) -> list[RequestSpec]:
    """Prompt set x repeats -> request specs; key = id, or id#r<k> when repeating."""
    specs = []
    for k in range(cfg.repeat):
        for p in prompts:
            o = p.overrides
            specs.append(
                RequestSpec(
                    key=p.id if cfg.repeat == 1 else f"{p.id}#r{k}",
                    prompt=p.prompt,
                    max_tokens=o.get("max_tokens", cfg.max_tokens),
                    top_logprobs=o.get("top_logprobs", cfg.top_logprobs),
                    ignore_eos=o.get("ignore_eos", cfg.ignore_eos),
                    stream=cfg.stream,
                    model=cfg.model,
                    temperature=float(o.get("temperature", 0.0)),
                    extra=p.extra,
                )
            )
    return specs


class Progress:
    """`capture 12/48  1 failed  2345 tok/s` on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.done = self.failed = self.tokens = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, ok: bool, n_tokens: int) -> None:
        self.done += 1
        self.failed += not ok
        self.tokens += n_tokens
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            sys.stderr.write(f"\rcapture {self.done}/{self.total}  {self.failed} failed  {rate:,.0f} tok/s ")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")


def _api_key(var: str | None) -> str | None:
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise ConfigError(f"--api-key-env {var}: the environment variable is not set or empty")
    return key


def _resume_source(out: Path, resume: bool) -> Path | None:
    """With --resume and an existing trace: move it aside; its ok rows are copied into a fresh file."""
    if not out.exists():
        return None
    if not resume:
        raise ConfigError(f"{out}: already exists; pass --resume to finish it, or choose another --out")
    prev = out.with_name(out.name + ".resume-prev")
    os.replace(out, prev)
    return prev


def _check_resumable(out: Path, cfg: CaptureConfig) -> None:
    if not (cfg.resume and out.exists()):
        return
    with TraceReader(out) as r:
        if r.meta.source != "http" or r.layout.topk != cfg.top_logprobs:
            raise ConfigError(
                f"{out}: cannot --resume: it holds a {r.meta.source} capture with top-k "
                f"{r.layout.topk}, this run asks for an http capture with --top-logprobs "
                f"{cfg.top_logprobs}"
            )


def _ok_rows(reader: TraceReader) -> dict[str, int]:
    t = reader.requests
    return {k: i for k, i in t.index_by_key().items() if t.status[i] == "ok"}


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _run_meta(cfg: CaptureConfig, pr, mapper: TokenMapper | None, n_prompts: int, rate) -> dict:
    eos = pr.eos_token_ids or (mapper.eos_token_ids() if mapper else [])
    return base_run(
        target=cfg.url,
        dialect=pr.dialect,
        dialect_reason=pr.reason,
        engine=pr.engine,
        model=cfg.model or pr.model,
        tokenizer=cfg.tokenizer or pr.tokenizer or None,
        eos_token_ids=eos,
        concurrency=cfg.concurrency,
        sampling={
            "max_tokens": cfg.max_tokens,
            "top_logprobs": cfg.top_logprobs,
            "ignore_eos": cfg.ignore_eos,
            "temperature": 0.0,
            "stream": cfg.stream,
        },
        cache={"reported_by": CACHE_FIELD.get(pr.dialect, "unknown"), "setting": cfg.run_meta.get("cache", "unknown")},
        token_ids=("engine ids where sent; token strings mapped with the tokenizer at " + cfg.tokenizer)
        if cfg.tokenizer
        else "engine ids where sent; strings-only engines leave -1 (no --tokenizer)",
        arrival=cfg.arrival if rate is None else {"poisson_rate_per_s": rate, "seed": cfg.seed},
        repeat=cfg.repeat,
        timeout_s=cfg.timeout_s,
        prompts={"path": cfg.prompts, "sha256": _sha256(cfg.prompts), "n": n_prompts},
        **{k: v for k, v in cfg.run_meta.items() if k != "cache"},
    )


def run_capture(cfg: CaptureConfig) -> CaptureSummary:
    """Run a whole capture (blocking). Raises TracekitError for setup problems only."""
    if cfg.concurrency < 1 or cfg.repeat < 1 or cfg.timeout_s <= 0 or cfg.top_logprobs < 0 or cfg.max_tokens < 1:
        raise ConfigError("--concurrency, --repeat, --max-tokens must be >= 1, --timeout-s > 0, --top-logprobs >= 0")
    if cfg.dialect != "auto":
        dialects.get(cfg.dialect)
    return asyncio.run(_run(cfg))


async def _run(cfg: CaptureConfig) -> CaptureSummary:
    rate = parse_arrival(cfg.arrival)
    prompts = load_prompts(cfg.prompts)
    mapper = TokenMapper(cfg.tokenizer) if cfg.tokenizer else None
    specs = plan_requests(prompts, cfg)
    api_key = _api_key(cfg.api_key_env)
    base = cfg.url.rstrip("/")
    out = Path(cfg.out)
    async with make_session(cfg.concurrency, cfg.timeout_s, api_key) as session:
        pr = await probe(session, base, cfg.dialect)
        dialect = dialects.get(pr.dialect)
        model = cfg.model or pr.model
        if (model and model != cfg.model) or pr.extra_body:
            specs = [dataclasses.replace(s, model=model, extra={**pr.extra_body, **s.extra}) for s in specs]
        for s in specs:
            dialect.body(s)  # a prompt the dialect cannot send is a ConfigError now, before any file exists
        meta = RunMeta(
            source="http",
            run=_run_meta(cfg, pr, mapper, len(prompts), rate),
            layout=Layout(topk=cfg.top_logprobs, raw_logits=pr.raw_logits),
        )
        _check_resumable(out, cfg)
        prev = _resume_source(out, cfg.resume)
        kept = 0
        # Chunk-size hint: planned requests x max_tokens (a small run gets small files).
        hint = sum(s.max_tokens for s in specs)
        with TraceWriter(out, meta, expected_tokens=hint) as writer:
            if prev is not None:
                with TraceReader(prev) as reader:
                    ok = _ok_rows(reader)
                    kept = copy_requests(reader, writer, sorted(ok.values()))
                specs = [s for s in specs if s.key not in ok]
            t0 = time.perf_counter()
            counts, ntok, (lat, failures) = await _send_all(session, base, dialect, specs, cfg, writer, mapper, rate)
            wall = time.perf_counter() - t0
        if prev is not None:
            prev.unlink()
    return CaptureSummary(
        str(out), len(specs) + kept, kept, counts, ntok, wall, pr.dialect, _percentiles(lat), failures
    )


async def _send_all(session, base, dialect, specs, cfg, writer, mapper, rate) -> tuple[dict, int, tuple]:
    clock = Clock()
    sem = asyncio.Semaphore(cfg.concurrency)
    prog = Progress(len(specs), sys.stderr.isatty() if cfg.progress is None else cfg.progress)
    counts = {"ok": 0, "error": 0, "cancelled": 0, "timeout": 0}
    started: dict[str, float] = {}
    pending: list[Outcome] = []
    finished: set[str] = set()
    lat: dict[str, list] = {"ttft_s": [], "e2e_s": [], "itl_s": []}
    failures: list[tuple] = []
    k, raw = cfg.top_logprobs, writer.layout.raw_logits
    delays = _arrival_times(len(specs), rate, cfg.seed)

    async def one(spec: RequestSpec, at: float) -> None:
        if at > 0:
            await asyncio.sleep(max(0.0, at - clock()))
        async with sem:
            outcome, acc = await send(session, base, dialect, spec, clock, started)
        outcome = _flag_unknown_ids(finish(outcome, acc, k, raw, mapper), cfg.tokenizer)
        pending.append(outcome)
        finished.add(spec.key)
        rec = outcome.record
        if rec.status != "ok" and len(failures) < 20:
            failures.append((rec.key, rec.status, rec.error))
        if rec.status == "ok":
            lat["ttft_s"].append(rec.ttft_s)
            lat["e2e_s"].append(rec.e2e_s)
            if spec.stream and outcome.tokens is not None:
                lat["itl_s"].append(np.diff(outcome.tokens.t_arrival_s))
        counts[outcome.record.status] += 1
        prog.update(outcome.record.status == "ok", len(outcome.tokens) if outcome.tokens is not None else 0)
        if len(pending) == 1:
            # Group commit: write (and flush) everything that completes in this loop
            # iteration at once; one append costs ~25 dataset writes whatever its size.
            asyncio.get_running_loop().call_soon(write_pending)

    def write_pending() -> None:
        if not pending:
            return
        batch = pending[:]
        pending.clear()
        writer.append_many([(o.record, o.tokens, o.prompt_ids) for o in batch])

    tasks = [asyncio.ensure_future(one(s, at)) for s, at in zip(specs, delays)]
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        write_pending()
        _write_cancelled(writer, [s for s in specs if s.key in started and s.key not in finished], started, clock())
        raise
    finally:
        prog.close()
    write_pending()
    return counts, prog.tokens, (lat, failures)


def _write_cancelled(writer: TraceWriter, specs: list[RequestSpec], started: dict, now: float) -> None:
    """In-flight requests of an interrupted run become `cancelled` rows; unsent ones stay
    missing (--resume runs them)."""
    writer.append_many(
        [
            (
                RequestRecord(
                    key=s.key,
                    prompt_hash=prompt_hash(s.prompt),
                    status="cancelled",
                    error="capture interrupted",
                    t_sent_s=started[s.key],
                    t_done_s=now,
                ),
                None,
                None,
            )
            for s in specs
        ]
    )


def _flag_unknown_ids(outcome: Outcome, tokenizer: str | None) -> Outcome:
    """An ok row whose engine sent strings we could not map keeps status ok, with a note."""
    toks = outcome.tokens
    if toks is None or outcome.record.status != "ok" or not (toks.token_id < 0).any():
        return outcome
    why = f"not in the vocabulary of {tokenizer}" if tokenizer else "pass --tokenizer DIR"
    note = f"token ids unknown for {int((toks.token_id < 0).sum())} tokens: the engine sent token strings only; {why}"
    return Outcome(dataclasses.replace(outcome.record, error=note), toks, outcome.prompt_ids)


def _arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the run start at which each request may be sent (burst: all 0)."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
