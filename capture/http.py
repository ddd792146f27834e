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
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from tracekit.errors import ConfigError, UsageError
from tracekit.percentiles import percentiles
from tracekit.schema import Layout, RequestRecord, RunMeta, prompt_hash
from tracekit.store import TraceWriter

from . import dialects, metrics, resume, runmeta
from .client import Clock, Outcome, RouteWatch, finish, make_session, prompt_ids_for, send
from .dialects import RequestSpec, tgi
from .pitfalls import Pitfalls, Watch, at_start
from .postprocess import Post
from .probe import probe
from .prompts import DEFAULT_MAX_TOKENS, Prompt, load_prompts
from .tokens import TokenMapper


@dataclass(frozen=True)
class CaptureConfig:
    url: str
    prompts: str
    out: str
    concurrency: int = 1
    max_tokens: int | None = None  # None: the prompt's own, else DEFAULT_MAX_TOKENS; given, it wins
    top_logprobs: int = 20
    ignore_eos: bool | None = None  # None: the prompt's own, else False; given, it wins
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
    dtype: str | None = None  # the engine's dtype when it does not report it (fp32 | bf16 | fp16)
    logprobs_mode: str = "auto"  # what the logprob fields hold; *_logits: stored as raw top-k logits
    wait_ready_s: float = 0.0  # wait this long for an engine still loading (503) or not listening yet
    cache_prompt: bool | None = None  # llama.cpp's per-request cache_prompt; None: not sent (the server decides)
    eos_token_ids: tuple[int, ...] = ()  # EOS ids given as is (a matrix target's); the engine's report wins
    # A cold reference (the matrix runner): POST this route (e.g. `tracekit serve`'s and vLLM's
    # /reset_prefix_cache) before every request, so that each one meets an empty prefix cache.
    # Concurrency 1 only; checked once before the first request (an engine that does not empty
    # its cache there is a ConfigError), a later failure is a pitfall of the run.
    reset_path: str = ""


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
    unknown_id_tokens: int = 0  # tokens of ok rows stored with id -1 (strings the capture could not map)
    prefix_cache_counters: dict = field(default_factory=dict)  # metrics.prefix_counters over the run
    pitfalls: list = field(default_factory=list)  # codes of the run's pitfalls (capture/pitfalls.py)
    unknown_topk_entries: int = 0  # top-k candidates of ok rows with a value but id -1 (strings as above)

    @property
    def failed(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "ok")

    @property
    def trace_counts(self) -> dict:
        """Every row the trace now holds, by status: this run's, plus the ok rows --resume kept
        (a resume keeps only ok rows and sends every other again). `counts` is this run's only."""
        return {**self.counts, "ok": self.counts.get("ok", 0) + self.kept}

    def as_dict(self) -> dict:
        return {
            "out": self.out,
            "planned": self.planned,
            "kept_from_resume": self.kept,
            "counts": self.counts,  # the requests sent by this run
            "trace_counts": self.trace_counts,  # every row of the trace (kept ones included)
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 3),
            "dialect": self.dialect,
            "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s > 0 else None,
            "latency": self.latency,
            "failures": [list(f) for f in self.failures],
            "unknown_id_tokens": self.unknown_id_tokens,
            "unknown_topk_entries": self.unknown_topk_entries,
            "prefix_cache_counters": self.prefix_cache_counters,
            "pitfalls": self.pitfalls,
        }


def _percentiles(samples: dict[str, list]) -> dict:
    """{name: [seconds or arrays of them]} -> {name: {p50, p90, p99}} (names with no samples are left out)."""
    out = {}
    for name, xs in samples.items():
        p = percentiles(np.concatenate([np.atleast_1d(np.asarray(x, np.float64)) for x in xs]) if xs else ())
        if p:
            out[name] = p
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
    """Prompt set x repeats -> request specs; key = id, or id#r<k> when repeating.

    Precedence of a sampling setting: the command line when it sets it (max_tokens, ignore_eos
    not None), else the prompt's own field, else the default. top_logprobs: the prompt's own up to
    the trace's k (the command line's), which the layout fixes. temperature: the prompt's, else 0."""
    specs = []
    for k in range(cfg.repeat):
        for p in prompts:
            o = p.overrides
            specs.append(
                RequestSpec(
                    key=p.id if cfg.repeat == 1 else f"{p.id}#r{k}",
                    prompt=p.prompt,
                    max_tokens=_first(cfg.max_tokens, o.get("max_tokens"), DEFAULT_MAX_TOKENS),
                    top_logprobs=o.get("top_logprobs", cfg.top_logprobs),
                    ignore_eos=_first(cfg.ignore_eos, o.get("ignore_eos"), False),
                    stream=cfg.stream,
                    model=cfg.model,
                    temperature=float(o.get("temperature", 0.0)),
                    extra=p.extra,
                    cache_prompt=cfg.cache_prompt,
                )
            )
    return specs


def _first(*values):
    return next(v for v in values if v is not None)


def precedence_notes(prompts: list[Prompt], cfg: CaptureConfig) -> list[str]:
    """One line per setting that the command line gives and some prompts set otherwise."""
    notes = []
    for name, flag, given in (
        ("max_tokens", "--max-tokens", cfg.max_tokens),
        ("ignore_eos", "--ignore-eos", cfg.ignore_eos),
    ):
        own = [p.overrides[name] for p in prompts if name in p.overrides and p.overrides[name] != given]
        if given is not None and own:
            shown = ", ".join(sorted({str(v).lower() for v in own}))
            flag = flag if given is not False else "--no-ignore-eos"
            notes.append(
                f"note: {flag}{'' if isinstance(given, bool) else f' {given}'} applies to every request; "
                f"{len(own)} prompt(s) of {cfg.prompts} set {name} {shown}, which the command line overrides"
            )
    return notes


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


def run_capture(cfg: CaptureConfig) -> CaptureSummary:
    """Run a whole capture (blocking). Raises TracekitError for setup problems only."""
    bad = [
        f"--{name} {value}: must be {rule}"
        for name, value, ok, rule in (
            ("concurrency", cfg.concurrency, cfg.concurrency >= 1, ">= 1"),
            ("repeat", cfg.repeat, cfg.repeat >= 1, ">= 1"),
            ("max-tokens", cfg.max_tokens, cfg.max_tokens is None or cfg.max_tokens >= 1, ">= 1"),
            ("timeout-s", cfg.timeout_s, cfg.timeout_s > 0, "> 0"),
            ("top-logprobs", cfg.top_logprobs, cfg.top_logprobs >= 0, ">= 0"),
        )
        if not ok
    ]
    if bad:  # name only the options that are wrong
        raise UsageError("; ".join(bad))
    if cfg.reset_path and cfg.concurrency != 1:
        raise ConfigError("a cold capture (reset_path) runs one request at a time: concurrency must be 1")
    if cfg.dialect != "auto":
        dialects.get(cfg.dialect)
    return asyncio.run(_run(cfg))


async def _run(cfg: CaptureConfig) -> CaptureSummary:
    rate = parse_arrival(cfg.arrival)
    prompts = load_prompts(cfg.prompts)
    mapper = TokenMapper(cfg.tokenizer) if cfg.tokenizer else None
    specs = plan_requests(prompts, cfg)
    for note in precedence_notes(prompts, cfg):
        print(note, file=sys.stderr)
    api_key = _api_key(cfg.api_key_env)
    base = cfg.url.rstrip("/")
    out = Path(cfg.out)
    async with make_session(cfg.concurrency, cfg.timeout_s, api_key) as session:
        pr, specs, run, known_ids = await _setup(session, base, cfg, specs, len(prompts), rate)
        why = await reset_cache(session, base, cfg.reset_path) if cfg.reset_path else None
        if why is not None:
            raise ConfigError(
                f"{base}: POST {cfg.reset_path} did not empty the prefix cache ({why}); a cold reference needs it"
            )
        resume.check(out, cfg.resume, cfg.top_logprobs, run)
        pitfalls = Pitfalls()
        at_start(specs, run, pr.engine_kind, pitfalls)
        run["pitfalls"] = pitfalls.as_list()  # a killed run keeps these; the rest are added at close
        logits_mode = run["logprobs_mode"] in runmeta.LOGIT_MODES
        meta = RunMeta(
            source="http", run=run, layout=Layout(topk=cfg.top_logprobs, raw_logits=pr.raw_logits or logits_mode)
        )
        prev = resume.prepare(out, cfg.resume)
        # Chunk-size hint: planned requests x max_tokens (a small run gets small files).
        writer = TraceWriter(out, meta, expected_tokens=sum(s.max_tokens for s in specs))
        copied = False
        try:
            kept, specs = resume.copy_kept(prev, writer, specs)
            copied = True
            watch = Watch(pitfalls, pr.dialect, pr.engine_kind, run["cache"]["reported_by"])
            post = Post(cfg.tokenizer, logits_mode, writer.layout, pitfalls, watch)
            before = await metrics.fetch(session, base)  # the engine's prefix-cache counters around the run
            t0 = time.perf_counter()
            counts, ntok, (lat, failures) = await _send_all(
                session, base, dialects.get(pr.dialect), specs, cfg, writer, mapper, rate, post, known_ids
            )
            wall = time.perf_counter() - t0
            counters = metrics.prefix_counters(before, await metrics.fetch(session, base))
            watch.finish()
            writer.set_run({**run, "pitfalls": pitfalls.as_list(), "prefix_cache_counters": counters})
        finally:
            writer.close()
            if copied:  # reached only when the close did not raise: <out> holds every kept row
                resume.done(prev, out)
    return CaptureSummary(
        str(out), len(specs) + kept, kept, counts, ntok, wall, pr.dialect, _percentiles(lat), failures, post.unknown,
        counters, [p["code"] for p in pitfalls.as_list()], post.unknown_topk,
    )  # fmt: skip


async def _setup(session, base: str, cfg: CaptureConfig, specs: list[RequestSpec], n_prompts: int, rate):
    """Probe the engine and plan what it needs: (probe result, specs with the engine's model and
    extra body fields, run metadata, {text: prompt ids})."""
    pr = await probe(session, base, cfg.dialect, cfg.wait_ready_s)
    dialect = dialects.get(pr.dialect)
    model = cfg.model or pr.model
    if (model and model != cfg.model) or pr.extra_body:
        specs = [dataclasses.replace(s, model=model, extra={**pr.extra_body, **s.extra}) for s in specs]
    for s in specs:
        dialect.body(s)  # a prompt the dialect cannot send is a ConfigError now, before any file exists
    if pr.dialect == "tgi":
        await _tgi_top_n(session, base, max((s.top_logprobs for s in specs), default=0))
    numerics = await runmeta.engine_numerics(session, base, pr.dialect, pr.engine)
    run = runmeta.build(cfg, pr, specs, n_prompts, rate, numerics)
    known_ids, run["prompt_ids"] = await prompt_ids_for(session, base, pr, specs, cfg.tokenizer)
    return pr, specs, run, known_ids


async def reset_cache(session, base: str, path: str) -> str | None:
    """POST base+path (a prefix-cache reset); None when it answered 2xx, else what went wrong."""
    try:
        async with session.post(base + path) as r:
            body = await r.text()
            return None if 200 <= r.status < 300 else f"HTTP {r.status}: {body[:120]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}: {e}"


async def _tgi_top_n(session, base: str, k: int) -> None:
    """TGI refuses top_n_tokens above its --max-top-n-tokens and never says the limit: ask once
    (dialects/tgi.py: top_n_probe), so a too large --top-logprobs stops here, not in every row."""
    if not k:
        return
    try:
        async with session.post(base + "/generate", json=tgi.top_n_probe(k)) as r:
            refused = tgi.top_n_refusal(k, r.status, await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return  # unreachable now: the requests will say so
    if refused:
        raise ConfigError(refused)


async def _send_all(
    session, base, dialect, specs, cfg, writer, mapper, rate, post, known_ids
) -> tuple[dict, int, tuple]:
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
    watch = RouteWatch(dialect, min(3, len(specs)))  # all 404 at first: the dialect looks wrong

    async def one(spec: RequestSpec, at: float) -> None:
        if at > 0:
            await asyncio.sleep(max(0.0, at - clock()))
        async with sem:
            if cfg.reset_path:  # a cold reference: every request meets an empty prefix cache
                why = await reset_cache(session, base, cfg.reset_path)
                if why is not None:
                    post.warn("cold_reset_failed", f"POST {cfg.reset_path} failed before {spec.key}: {why}")
            ids = known_ids.get(spec.prompt) if isinstance(spec.prompt, str) else None  # text prompts' ids
            outcome, acc = await send(session, base, dialect, spec, clock, started, ids)
        outcome = post(finish(outcome, acc, k, raw, mapper), spec)
        watch.seen(outcome.record)
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
        writer.append_many([o.row if o.row is not None else (o.record, o.tokens, o.prompt_ids) for o in batch])

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
