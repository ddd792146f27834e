"""Engines' Prometheus `/metrics`, read by exact name per engine family.

Each engine names its gauges and counters its own way; a suffix match is wrong
(`prefix_cache_hits_total` also matches vLLM's `external_prefix_cache_hits_total`,
a connector's hits, not the engine's). So the family is recognised by the exact
names it exports, and each reader takes that family's names, or says why not
when the family has no such metric.

`FAMILIES` below is the one table: per family its running and waiting gauges, its
prefix-reuse (hit) counter, the counters whose sum is the prompt tokens looked up
in the prefix cache (queries), and (tracekit only) its cancelled-requests counter.
All these counters count tokens: vLLM's and tracekit's hits and queries; SGLang's
cached prompt tokens out of all its prompt tokens; llama.cpp's cached prompt tokens
out of cached plus processed ones (its `prompt_tokens_total` excludes the cached).
TGI exports none. llama.cpp serves /metrics only with `--metrics`.

Used by the HTTP capture (the counters' deltas around a run, `prefix_counters`) and
by the matrix's lifecycle checks (the drain gauges).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import aiohttp

_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$", re.M)


@dataclass(frozen=True)
class Family:
    name: str
    running: str | None  # gauge: requests being generated
    waiting: str | None  # gauge: requests queued
    reuse: str | None  # counter: prompt tokens served from the prefix cache (hits)
    queries: tuple[str, ...] = ()  # counters whose sum is the prompt tokens looked up in the cache
    cancelled: str | None = None  # counter: requests cancelled by a client disconnect
    slots_busy: str | None = None

    def names(self) -> tuple[str, ...]:
        named = (self.running, self.waiting, self.reuse, *self.queries, self.cancelled, self.slots_busy)
        return tuple(n for n in named if n)


FAMILIES = (
    Family(
        "tracekit",
        "tracekit:num_requests_running",
        "tracekit:num_requests_waiting",
        "tracekit:prefix_cache_hits_total",
        ("tracekit:prefix_cache_queries_total",),
        "tracekit:requests_cancelled_total",
        "tracekit:slots_busy",
    ),
    Family(
        "vllm",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        ("vllm:prefix_cache_queries_total",),
    ),
    Family(
        "sglang",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:cached_tokens_total",
        ("sglang:prompt_tokens_total",),
    ),
    Family("tgi", "tgi_batch_current_size", "tgi_queue_size", None),
    Family(
        "llamacpp",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_cached_total",
        ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
    ),
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labelled series summed per name."""
    out: dict[str, float] = {}
    for name, _, value in _METRIC.findall(text):
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def family_of(m: dict[str, float] | None) -> Family | None:
    """The engine family whose exact names the metrics hold (the most of them), else None."""
    if not m:
        return None
    best = max(FAMILIES, key=lambda f: sum(n in m for n in f.names()))
    return best if any(n in m for n in best.names()) else None


def value(m: dict[str, float] | None, name: str | None) -> float | None:
    """The metric called exactly `name`, or None when the engine does not export it."""
    return None if m is None or name is None else m.get(name)


def delta(before: dict[str, float] | None, after: dict[str, float] | None, name: str | None) -> float | None:
    """after - before of a counter; None when either side lacks it."""
    a, b = value(before, name), value(after, name)
    return None if a is None or b is None else b - a


def unknown_family(m: dict[str, float] | None) -> str:
    """Why no family matched: no /metrics, or the names it does export (a few)."""
    if m is None:
        return "the engine serves no /metrics"
    names = sorted(m)
    return (
        f"/metrics holds no name of a known engine family ({', '.join(f.name for f in FAMILIES)}); "
        f"it exports {', '.join(names[:5]) or 'nothing'}{' ...' if len(names) > 5 else ''}"
    )


def total_delta(
    before: dict[str, float] | None, after: dict[str, float] | None, names: tuple[str, ...]
) -> float | None:
    """The summed delta of several counters; None when any is missing (or none is named)."""
    parts = [delta(before, after, n) for n in names]
    return None if not parts or None in parts else float(sum(parts))


def prefix_counters(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The engine's prefix-cache counters between two /metrics reads, for the run metadata:
    {family, hits, queries (the counter names), hits_delta, queries_delta (tokens; None where the
    engine lacks the counter), why (when a delta is unknown)}. Engine-wide: other clients'
    requests in the same interval count too."""
    fam = family_of(after) or family_of(before)
    if fam is None:
        return {"family": None, "hits_delta": None, "queries_delta": None, "why": unknown_family(after)}
    hits, queries = delta(before, after, fam.reuse), total_delta(before, after, fam.queries)
    out = {
        "family": fam.name,
        "hits": fam.reuse,
        "queries": list(fam.queries),
        "hits_delta": hits,
        "queries_delta": queries,
    }
    if hits is None:
        out["why"] = (
            f"{fam.name} /metrics lacks {fam.reuse}" if fam.reuse else f"{fam.name} exports no prefix-reuse counter"
        )
    return out


async def fetch(session: aiohttp.ClientSession, base: str) -> dict[str, float] | None:
    """One read of the engine's /metrics; None when it serves none (or does not answer in 10 s)."""
    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return parse_metrics(await r.text()) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return None
