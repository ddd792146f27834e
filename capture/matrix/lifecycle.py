"""Lifecycle checks of one cell, each pass / fail / skip with its evidence.

- completion: every request of the serial baseline and of the burst is `ok`.
- prefix_cache: with the cache on, the burst re-sends prompts the baseline
  already sent, so reuse is expected: cached_tokens > 0 (or the engine's hit
  counter moved over the burst, as the capture recorded it in the run metadata's
  `prefix_cache_counters`). With it off, no reuse may be reported.
- cancel_drain: K streams disconnected after a few tokens; the engine's
  /metrics (its family's gauges, capture/metrics.py) must show no running or waiting
  request within a timeout; skipped, with the reason, without such gauges.
- cancel_then_match: a probe request sent after the drain must return the
  token ids of (a) the same request sent just before the disconnects, whatever
  prefix the engine reused each time (a changed `cached_tokens` is reported as
  information: llama.cpp's slots hold other prompts after a cancel), and
  (b) its serial-baseline row where that reused the same prefix (at another
  prefix a difference is said, and left to the cell's diff). The probe is a
  baseline key that already reused a prefix in the baseline where there is one.
- bad_request: the dialect's invalid body (`bad_body`: a wrong-typed token
  limit) is rejected with HTTP 400 or 422 (TGI), then the ready path answers
  200 and a small request still completes.

A failing check is a result: it is returned with its evidence, never retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import numpy as np

from tracekit.errors import TracekitError
from tracekit.rundir import Check
from tracekit.schema import RequestTable
from tracekit.text import clip

from .. import dialects
from ..client import Clock, make_session, send
from ..dialects import RequestSpec
from ..metrics import delta, family_of, fetch, unknown_family, value
from ..probe import probe
from ..sse import SSEDecoder


def completion_check(name: str, table: RequestTable | None, planned: int, error: str = "") -> Check:
    if table is None:
        return Check(name, "fail", f"capture did not run: {error}", {"planned": planned})
    counts = table.counts_by_status()
    ok = counts.get("ok", 0)
    errors = sorted({e for e, s in zip(table.error, table.status) if s != "ok" and e})[:3]
    status = "pass" if ok == planned and len(table) == planned else "fail"
    return Check(name, status, f"{ok}/{planned} completed", {"counts": counts, "planned": planned, "errors": errors})


def prefix_cache_check(
    table: RequestTable | None,
    cache_on: bool,
    reuse_delta: float | None,
    counter: str | None,
    why_none: str = "",
    queries_delta: float | None = None,
) -> Check:
    """Reuse seen in the burst: per-request cached_tokens, else the engine's reuse counter
    (`counter`, its delta over the burst; `queries_delta`: the prompt tokens looked up meanwhile).
    Skip, with the reason, when the engine reports neither."""
    if table is None or not len(table):
        return Check("prefix_cache", "skip", "no burst rows to inspect")
    ct = table.cached_tokens[table.status == "ok"]
    known = ct[ct >= 0]
    ev = {
        "requests": int(len(ct)),
        "reported": int(len(known)),
        "reused": int(np.sum(known > 0)),
        "mean_cached_tokens": float(known.mean()) if len(known) else None,
        "counter": counter,
        "counter_delta": reuse_delta,
        "counter_queries_delta": queries_delta,
    }
    if not len(known) and reuse_delta is None:
        why = why_none or f"the engine's metrics have no prefix-reuse counter ({counter or 'none known'})"
        return Check("prefix_cache", "skip", f"no per-request cached_tokens and {why}", ev)
    reused = int(np.sum(known > 0)) if len(known) else 0
    hit = reused > 0 or (reuse_delta or 0) > 0
    moved = f"{counter} +{reuse_delta:g}" if reuse_delta is not None else "no reuse counter"
    if reuse_delta is not None and queries_delta is not None:
        moved += f" of {queries_delta:g} prompt tokens looked up"
    if cache_on:
        return Check(
            "prefix_cache",
            "pass" if hit else "fail",
            f"{reused}/{len(ct)} burst requests reused a prefix (expected > 0); {moved}",
            ev,
        )
    return Check(
        "prefix_cache",
        "fail" if hit else "pass",
        f"cache off: {reused}/{len(ct)} requests reported reuse, {moved} (expected 0)",
        ev,
    )


def reuse_check(table: RequestTable | None, cache_on: bool, counters: dict | None) -> Check:
    """prefix_cache with the engine's counters as the burst's capture recorded them around itself
    (run metadata `prefix_cache_counters`, capture/metrics.py: prefix_counters)."""
    c = counters or {}
    why = c.get("why") or ("" if counters else "the capture recorded no engine counters")
    return prefix_cache_check(table, cache_on, c.get("hits_delta"), c.get("hits"), why, c.get("queries_delta"))


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
    """Wait until the engine's running and waiting gauges (its family's exact names) reach 0."""
    t0 = time.perf_counter()
    m = await fetch(session, base)
    fam = family_of(m)
    if fam is None:
        return Check("cancel_drain", "skip", f"no running-requests gauge to watch: {unknown_family(m)}")
    if value(m, fam.running) is None:
        return Check("cancel_drain", "skip", f"{fam.name} /metrics lacks {fam.running or 'a running-requests gauge'}")
    while True:
        # A family without a waiting gauge is judged on running alone (said in the summary).
        running, waiting = value(m, fam.running), value(m, fam.waiting)
        idle = running == 0 and not waiting
        waited = time.perf_counter() - t0
        if idle or waited > timeout_s:
            break
        await asyncio.sleep(0.05)
        m = await fetch(session, base) or m
    cancelled = delta(before, m, fam.cancelled)
    ev = {
        "family": fam.name,
        "gauges": [fam.running, fam.waiting],
        "seconds_to_idle": round(waited, 3),
        "running": running,
        "waiting": waiting,
        "timeout_s": timeout_s,
        "cancelled_counter_delta": cancelled,
        "slots_busy": value(m, fam.slots_busy),
    }
    gauges = f"{fam.running} 0" + (f", {fam.waiting} 0" if waiting is not None else "; no waiting gauge")
    if idle:
        return Check(
            "cancel_drain",
            "pass",
            f"idle {waited:.2f} s after the disconnects ({fam.name}: {gauges}; cancelled counter "
            f"+{cancelled if cancelled is not None else '? (not exported)'})",
            ev,
        )
    return Check("cancel_drain", "fail", f"still {running:g} running / {waiting} waiting after {timeout_s:g} s", ev)


def _outcome_view(o, acc) -> dict:
    return {
        "key": o.record.key,
        "status": o.record.status,
        "http_status": o.record.http_status,
        "error": clip(o.record.error, 200),
        "cached_tokens": o.record.cached_tokens,
        "token_ids": acc.token_ids(),  # ints; -1 where the engine sent a string no id is known for
        "n_tokens": len(acc.lps),
    }


def _first_diff(a: list, b: list) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return first if first is not None or len(a) == len(b) else min(len(a), len(b))


def _match(before: dict, after: dict, baseline: dict | None, lp_b: list, lp_a: list) -> Check:
    """The probe after the drain must give the token ids of the probe before the disconnects, at
    whatever prefix the engine reused then: that is what a cancel must not change. A changed
    reused prefix (llama.cpp's slots hold other prompts after a cancel) is information, said in
    the line and the evidence, never a failure by itself. The serial baseline is compared too; it
    fails the check only at the same reused prefix (elsewhere the cell's diff judges the pair)."""
    ev = {"probe_key": after["key"], "before": before, "after": after, "baseline": baseline}
    if before["status"] != "ok" or after["status"] != "ok":
        return Check(
            "cancel_then_match", "fail", f"probe status before {before['status']}, after {after['status']}", ev
        )
    if any(t < 0 for t in before["token_ids"] + after["token_ids"]):
        return Check(
            "cancel_then_match",
            "skip",
            f"{after['key']}: token ids unknown (the engine sent token strings without ids): nothing to compare",
            ev,
        )
    n = min(len(lp_a), len(lp_b))
    dlp = float(np.nanmax(np.abs(np.subtract(lp_a[:n], lp_b[:n])))) if n else float("nan")
    ev["max_abs_dlogprob_vs_before"] = dlp
    cb, ca = before["cached_tokens"], after["cached_tokens"]
    ev["reused_prefix_before"], ev["reused_prefix_after"] = cb, ca
    ev["reused_prefix_changed"] = cb != ca
    first = _first_diff(before["token_ids"], after["token_ids"])
    ev["first_difference_vs_before"] = first
    ev["tokens_match_before"] = first is None
    moved = f"reused prefix {cb} -> {ca} tokens" if cb != ca else f"same reused prefix {ca}"
    problems, parts = [], []
    if first is None:
        parts.append(f"tokens match the probe before the disconnects ({len(after['token_ids'])} ids)")
    else:
        problems.append(f"differs from the probe before the disconnects from position {first} ({moved})")
    if baseline is None:
        parts.append("no serial baseline")
    else:
        fb = _first_diff(baseline["token_ids"], after["token_ids"])
        ev["first_difference_vs_baseline"] = fb
        same = baseline["cached_tokens"] == ca
        where = "same reused prefix" if same else f"reused {baseline['cached_tokens']} vs {ca} tokens"
        if fb is None:
            parts.append(f"= its serial baseline ({where})")
        elif same:
            problems.append(f"differs from its serial baseline from position {fb} (same reused prefix {ca})")
        else:
            parts.append(
                f"differs from its serial baseline from position {fb} at another prefix ({where}: the diff judges it)"
            )
    if problems:
        return Check("cancel_then_match", "fail", f"{after['key']} after the drain: " + "; ".join(problems), ev)
    info = f"; {moved} (information: the engine's cache changed, the output did not)" if cb != ca else ""
    return Check(
        "cancel_then_match",
        "pass",
        f"{after['key']}: " + ", ".join(parts) + info + f"; max |Δlogprob| {dlp:.3g}",
        ev,
    )


REJECTED = (400, 422)  # a validation error: 400 (OpenAI servers, SGLang, llama.cpp), 422 (TGI)


async def _bad_request(session, base: str, dialect, spec: RequestSpec, ready_path: str, clock) -> Check:
    """The dialect's invalid body (a wrong-typed token limit) must be rejected (400 or 422),
    then the ready path must answer 200 and a 2-token request complete."""
    body = dialect.bad_body(dataclasses.replace(spec, stream=False))
    async with session.post(
        base + dialect.route(False), data=json.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        status, text = r.status, (await r.text(errors="replace"))[:300]
    async with session.get(base + ready_path) as r:
        health = r.status
    o, acc = await send(session, base, dialect, dataclasses.replace(spec, max_tokens=2, key="after-bad"), clock)
    ev = {
        "dialect": dialect.name,
        "http_status": status,
        "expected": dialect.bad_status,
        "body": text,
        "health_after": health,
        "request_after": o.record.status,
    }
    ok = status in REJECTED and health == 200 and o.record.status == "ok"
    return Check(
        "bad_request",
        "pass" if ok else "fail",
        f"{dialect.name} body with a wrong-typed token limit -> HTTP {status} (want 400 or 422); "
        f"health {health}; next request {o.record.status}",
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
    api_key: str | None,
) -> list[Check]:
    base = url.rstrip("/")
    async with make_session(k_cancel + 2, timeout_s, api_key) as session:
        pr = await probe(session, base, "auto")
        d = dialects.get(pr.dialect)
        specs = [dataclasses.replace(s, model=pr.model or s.model, extra={**pr.extra_body, **s.extra}) for s in specs]
        clock = Clock()
        before_m = await fetch(session, base)
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
    api_key: str | None = None,
) -> list[Check]:
    """Cancellation, drain, match and bad-request checks against a running engine (blocking).
    specs[probe_i] is the probe; baseline: its serial row {token_ids, cached_tokens} or None;
    api_key: sent as `Authorization: Bearer` on every request (never recorded)."""
    try:
        return asyncio.run(
            _lifecycle(
                url, specs, probe_i, baseline, k_cancel, after_tokens, drain_timeout_s, timeout_s, ready_path, api_key
            )
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, TracekitError) as e:
        return [Check("lifecycle", "fail", f"checks could not run: {type(e).__name__}: {e}")]
