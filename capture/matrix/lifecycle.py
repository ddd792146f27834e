"""Lifecycle checks of one cell, each pass / fail / skip with its evidence.

- completion: every request of the serial baseline and of the burst is `ok`.
- prefix_cache: with the cache on, the burst re-sends prompts the baseline
  already sent, so reuse is expected: cached_tokens > 0 (or the engine's hit
  counter moved). With it off, no reuse may be reported.
- cancel_drain: K streams disconnected after a few tokens; the engine's
  /metrics must show no running or waiting request within a timeout.
- cancel_then_match: a probe request sent after the drain must return the
  token ids of (a) the same request sent just before the disconnects and
  (b) its serial-baseline row, each compared only at the same warm-cache
  state (equal cached_tokens; (b) is skipped, and says so, when the baseline
  reused a different prefix). The probe is a baseline key that already reused
  a prefix in the baseline where there is one, so (b) usually applies.
- bad_request: an invalid body (max_tokens -1) gets HTTP 400, then /health is
  200 and a small request still completes.

A failing check is a result: it is returned with its evidence, never retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

import aiohttp
import numpy as np

from tracekit.errors import TracekitError
from tracekit.rundir import Check
from tracekit.schema import RequestTable

from .. import dialects
from ..client import Clock, make_session, send
from ..dialects import RequestSpec
from ..probe import probe
from ..sse import SSEDecoder

_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$", re.M)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labelled series summed per name."""
    out: dict[str, float] = {}
    for name, _, value in _METRIC.findall(text):
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def metric(m: dict[str, float], suffix: str) -> float | None:
    """The value of the first metric whose name ends with `suffix` (tracekit:, vllm:, sglang: ...)."""
    return next((v for k, v in m.items() if k.endswith(suffix)), None)


def completion_check(name: str, table: RequestTable | None, planned: int, error: str = "") -> Check:
    if table is None:
        return Check(name, "fail", f"capture did not run: {error}", {"planned": planned})
    counts = table.counts_by_status()
    ok = counts.get("ok", 0)
    errors = sorted({e for e, s in zip(table.error, table.status) if s != "ok" and e})[:3]
    status = "pass" if ok == planned and len(table) == planned else "fail"
    return Check(name, status, f"{ok}/{planned} completed", {"counts": counts, "planned": planned, "errors": errors})


def prefix_cache_check(table: RequestTable | None, cache_on: bool, hits_delta: float | None) -> Check:
    if table is None or not len(table):
        return Check("prefix_cache", "skip", "no burst rows to inspect")
    ct = table.cached_tokens[table.status == "ok"]
    known = ct[ct >= 0]
    ev = {
        "requests": int(len(ct)),
        "reported": int(len(known)),
        "reused": int(np.sum(known > 0)),
        "mean_cached_tokens": float(known.mean()) if len(known) else None,
        "metrics_hits_delta": hits_delta,
    }
    if not len(known) and hits_delta is None:
        return Check("prefix_cache", "skip", "engine reports neither cached_tokens nor a hit counter", ev)
    reused = int(np.sum(known > 0)) if len(known) else 0
    hit = reused > 0 or (hits_delta or 0) > 0
    if cache_on:
        return Check(
            "prefix_cache",
            "pass" if hit else "fail",
            f"{reused}/{len(ct)} burst requests reused a prefix (expected > 0); "
            f"hit counter +{hits_delta if hits_delta is not None else '?'}",
            ev,
        )
    return Check(
        "prefix_cache",
        "fail" if hit else "pass",
        f"cache off: {reused}/{len(ct)} requests reported reuse (expected 0)",
        ev,
    )


async def _metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float] | None:
    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return parse_metrics(await r.text()) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def metrics_snapshot(url: str) -> dict[str, float] | None:
    async with aiohttp.ClientSession() as s:
        return await _metrics(s, url.rstrip("/"))


async def _stream_then_disconnect(session, base: str, dialect, spec: RequestSpec, n_tokens: int) -> dict:
    """Open a stream, read n_tokens data events, then drop the connection (a client disconnect)."""
    body = dialect.body(dataclasses.replace(spec, stream=True))
    got = 0
    try:
        async with session.post(
            base + dialect.route(True), data=json.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                return {"key": spec.key, "http_status": resp.status, "tokens_read": 0}
            dec = SSEDecoder()
            async for chunk in resp.content.iter_any():
                got += sum(1 for ev in dec.feed(chunk) if ev.data and ev.data != "[DONE]")
                if got >= n_tokens:
                    resp.close()  # closes the socket: the engine sees a disconnect mid-stream
                    break
            return {"key": spec.key, "http_status": resp.status, "tokens_read": got}
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"key": spec.key, "error": f"{type(e).__name__}: {e}", "tokens_read": got}


async def _drain(session, base: str, timeout_s: float, before: dict | None) -> Check:
    t0 = time.perf_counter()
    m = await _metrics(session, base)
    if m is None or metric(m, "num_requests_running") is None:
        return Check("cancel_drain", "skip", "engine exposes no /metrics with num_requests_running")
    while True:
        running, waiting = metric(m, "num_requests_running"), metric(m, "num_requests_waiting") or 0.0
        waited = time.perf_counter() - t0
        if (running == 0 and waiting == 0) or waited > timeout_s:
            break
        await asyncio.sleep(0.05)
        m = await _metrics(session, base) or m
    cancelled = metric(m, "requests_cancelled_total")
    delta = (
        None if cancelled is None or before is None else cancelled - (metric(before, "requests_cancelled_total") or 0)
    )
    ev = {
        "seconds_to_idle": round(waited, 3),
        "running": running,
        "waiting": waiting,
        "timeout_s": timeout_s,
        "cancelled_counter_delta": delta,
        "slots_busy": metric(m, "slots_busy"),
    }
    if running == 0 and waiting == 0:
        return Check(
            "cancel_drain",
            "pass",
            f"idle {waited:.2f} s after the disconnects (cancelled counter +{delta if delta is not None else '?'})",
            ev,
        )
    return Check("cancel_drain", "fail", f"still {running:g} running / {waiting:g} waiting after {timeout_s:g} s", ev)


def _outcome_view(o, acc) -> dict:
    return {
        "key": o.record.key,
        "status": o.record.status,
        "http_status": o.record.http_status,
        "error": o.record.error[:200],
        "cached_tokens": o.record.cached_tokens,
        "token_ids": list(acc.ids),
        "n_tokens": len(acc.lps),
    }


def _first_diff(a: list, b: list) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return first if first is not None or len(a) == len(b) else min(len(a), len(b))


def _match(before: dict, after: dict, baseline: dict | None, lp_b: list, lp_a: list) -> Check:
    ev = {"probe_key": after["key"], "before": before, "after": after, "baseline": baseline}
    if before["status"] != "ok" or after["status"] != "ok":
        return Check(
            "cancel_then_match", "fail", f"probe status before {before['status']}, after {after['status']}", ev
        )
    n = min(len(lp_a), len(lp_b))
    dlp = float(np.nanmax(np.abs(np.subtract(lp_a[:n], lp_b[:n])))) if n else float("nan")
    ev["max_abs_dlogprob_vs_before"] = dlp
    problems, parts = [], []
    for name, ref in (("the probe before the disconnects", before), ("its serial baseline", baseline)):
        if ref is None:
            parts.append(f"no {name}")
            continue
        if ref["cached_tokens"] != after["cached_tokens"]:
            parts.append(f"{name} not compared (reused {ref['cached_tokens']} vs {after['cached_tokens']} tokens)")
            if name.startswith("the probe"):
                problems.append(f"reused prefix {ref['cached_tokens']} -> {after['cached_tokens']} tokens")
            continue
        first = _first_diff(ref["token_ids"], after["token_ids"])
        ev[f"first_difference_vs_{'before' if ref is before else 'baseline'}"] = first
        if first is None:
            parts.append(f"= {name}")
        else:
            problems.append(f"differs from {name} from position {first} (same reused prefix {after['cached_tokens']})")
    if problems:
        return Check("cancel_then_match", "fail", f"{after['key']} after the drain: " + "; ".join(problems), ev)
    return Check(
        "cancel_then_match",
        "pass",
        f"{after['key']}: {len(after['token_ids'])} tokens " + ", ".join(parts) + f"; max |Δlogprob| {dlp:.3g}",
        ev,
    )


async def _bad_request(session, base: str, dialect, spec: RequestSpec, ready_path: str, clock) -> Check:
    body = dialect.body(dataclasses.replace(spec, stream=False))
    body["max_tokens"] = -1
    async with session.post(
        base + dialect.route(False), data=json.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        status, text = r.status, (await r.text(errors="replace"))[:300]
    async with session.get(base + ready_path) as r:
        health = r.status
    o, acc = await send(session, base, dialect, dataclasses.replace(spec, max_tokens=2, key="after-bad"), clock)
    ev = {"http_status": status, "body": text, "health_after": health, "request_after": o.record.status}
    ok = status == 400 and health == 200 and o.record.status == "ok"
    return Check(
        "bad_request",
        "pass" if ok else "fail",
        f"max_tokens=-1 -> HTTP {status} (want 400); health {health}; next request {o.record.status}",
        ev,
    )


async def _lifecycle(
    url: str,
    specs: list[RequestSpec],
    probe_i: int,
    baseline: dict | None,
    k_cancel: int,
    after_tokens: int,
    drain_timeout_s: float,
    timeout_s: float,
    ready_path: str,
) -> list[Check]:
    base = url.rstrip("/")
    async with make_session(k_cancel + 2, timeout_s) as session:
        pr = await probe(session, base, "auto")
        d = dialects.get(pr.dialect)
        specs = [dataclasses.replace(s, model=pr.model or s.model, extra={**pr.extra_body, **s.extra}) for s in specs]
        clock = Clock()
        before_m = await _metrics(session, base)
        o1, acc1 = await send(session, base, d, specs[probe_i], clock)
        cancels = await asyncio.gather(
            *[_stream_then_disconnect(session, base, d, specs[i % len(specs)], after_tokens) for i in range(k_cancel)]
        )
        drain = await _drain(session, base, drain_timeout_s, before_m)
        drain.evidence["streams"] = cancels
        o2, acc2 = await send(session, base, d, specs[probe_i], clock)
        match = _match(_outcome_view(o1, acc1), _outcome_view(o2, acc2), baseline, acc1.lps, acc2.lps)
        bad = await _bad_request(session, base, d, specs[probe_i], ready_path, clock)
    return [drain, match, bad]


def lifecycle_checks(
    url: str,
    specs: list[RequestSpec],
    *,
    probe_i: int = 0,
    baseline: dict | None = None,
    k_cancel: int,
    after_tokens: int,
    drain_timeout_s: float,
    timeout_s: float,
    ready_path: str = "/health",
) -> list[Check]:
    """Cancellation, drain, match and bad-request checks against a running engine (blocking).
    specs[probe_i] is the probe; baseline: its serial row {token_ids, cached_tokens} or None."""
    try:
        return asyncio.run(
            _lifecycle(url, specs, probe_i, baseline, k_cancel, after_tokens, drain_timeout_s, timeout_s, ready_path)
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, TracekitError) as e:
        return [Check("lifecycle", "fail", f"checks could not run: {type(e).__name__}: {e}")]
