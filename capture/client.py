"""The HTTP side of a capture: one aiohttp ClientSession per run, and one
function that sends a request and turns whatever happens into an `Outcome`.

Every request ends as an outcome with a status: ok, error (HTTP status and a
body excerpt, never headers), timeout, or cancelled (set by the run loop). A
stream that ends without the dialect's end marker, is cut mid-event, carries
malformed JSON or an error event is an error, not a success. Times are seconds
on the run's monotonic clock (`Clock`, t=0 at run start).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass

import aiohttp

from tracekit.errors import StreamProtocolError
from tracekit.schema import RequestRecord, TokenColumns, prompt_hash

from .dialects import Acc, Dialect, EngineErrorEvent, RequestSpec
from .sse import SSEDecoder

try:  # ~3x faster than json on top-k events; optional (the GPU image may lack it)
    from orjson import loads as _loads
except ImportError:
    from json import loads as _loads

ERROR_EXCERPT = 500  # characters of a response body kept in the trace


class Clock:
    """The run's monotonic clock: seconds since the run started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


@dataclass(frozen=True)
class Outcome:
    record: RequestRecord
    tokens: TokenColumns | None
    prompt_ids: list[int] | None


def make_session(concurrency: int, timeout_s: float, api_key: str | None = None) -> aiohttp.ClientSession:
    """One session per run. The connector allows exactly `concurrency` connections
    (the run loop's semaphore keeps requests from queueing inside aiohttp, so
    queueing never counts into a request's latency)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 30.0))
    # read_bufsize: SSE events with top-20 logprobs are several KB; a larger
    # buffer means fewer reads per event.
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers, read_bufsize=1 << 18, auto_decompress=True
    )


def _loads_slow(data: bytes | str, n: int):
    try:
        return json.loads(data)  # also takes NaN / Infinity, which orjson refuses
    except ValueError:
        raise StreamProtocolError(f"malformed JSON in stream event {n}: {data[:200]!r}") from None


async def _read_stream(resp: aiohttp.ClientResponse, dialect: Dialect, acc: Acc, clock: Clock) -> None:
    # The per-event path: raw data bytes from the SSE fast path straight into the JSON
    # parser (no text decoding), then one dialect call; per-token columns stay Python lists.
    dec = SSEDecoder()
    loads = _loads
    parse = dialect.parse_event
    feed = dec.feed_data
    n = 0
    try:
        async for chunk in resp.content.iter_any():
            t = clock()  # one clock read per network chunk: its events arrived together
            for data in feed(chunk):
                if type(data) is not bytes:  # an event with an `event:` type
                    if data.event == "error":
                        raise EngineErrorEvent(f"error event: {data.data[:ERROR_EXCERPT]}")
                    data = data.data.encode()
                if data == b"[DONE]":
                    acc.done = True
                    continue
                n += 1
                try:
                    obj = loads(data)
                except ValueError:
                    obj = _loads_slow(data, n)
                parse(obj, acc, t)
    finally:
        acc.n_events = n
    if dec.partial:
        raise StreamProtocolError(f"stream cut mid-event after {n} events")
    if not acc.done:
        what = "[DONE]" if dialect.done_marker else "its final event"
        raise StreamProtocolError(f"stream ended without {what} after {n} events")


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    dialect: Dialect,
    spec: RequestSpec,
    clock: Clock,
    started: dict | None = None,
) -> tuple[Outcome, Acc]:
    """Send one request and return its outcome (never raises for engine or
    network faults; CancelledError propagates to the run loop)."""
    body = dialect.body(spec)
    acc = Acc()
    status, http_status, error = "ok", -1, ""
    t_sent = clock()
    if started is not None:
        started[spec.key] = t_sent
    try:
        async with session.post(
            base_url + dialect.route(spec.stream), data=json.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            http_status = resp.status
            if resp.status != 200:
                text = await resp.text(errors="replace")
                status, error = "error", f"HTTP {resp.status}: {text[:ERROR_EXCERPT]}"
            elif spec.stream and resp.content_type != "application/json":
                await _read_stream(resp, dialect, acc, clock)
            else:  # asked not to stream, or the server answered a stream request with one JSON body
                raw = await resp.read()
                try:
                    obj = _loads(raw)
                except ValueError:
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        raise StreamProtocolError(f"malformed JSON body: {raw[:200]!r}") from None
                dialect.parse_response(obj, acc, clock())
    except asyncio.TimeoutError:
        status, error = "timeout", f"no complete response within the timeout ({len(acc.lps)} tokens read)"
    except (EngineErrorEvent, StreamProtocolError) as e:
        status, error = "error", str(e)[:ERROR_EXCERPT]
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # Valid JSON of a shape the dialect does not know: this request fails, the run goes on.
        status, error = "error", f"unexpected {dialect.name} response shape ({type(e).__name__}: {e})"[:ERROR_EXCERPT]
    except aiohttp.ClientError as e:
        status, error = "error", f"{type(e).__name__}: {str(e)[:ERROR_EXCERPT]}"
    t_done = clock()
    return Outcome(
        _record(spec, body, acc, status, http_status, error, t_sent, t_done), None, _prompt_ids(spec, acc)
    ), acc


def _prompt_ids(spec: RequestSpec, acc: Acc) -> list[int] | None:
    if not isinstance(spec.prompt, str):
        return list(spec.prompt)
    return acc.prompt_ids


def _record(
    spec: RequestSpec, body: dict, acc: Acc, status: str, http_status: int, error: str, t_sent: float, t_done: float
) -> RequestRecord:
    params = {k: v for k, v in body.items() if k not in ("prompt", "messages", "text", "input_ids", "inputs")}
    pids = _prompt_ids(spec, acc)
    return RequestRecord(
        key=spec.key,
        prompt_hash=prompt_hash(spec.prompt),
        status=status,
        http_status=http_status,
        error=error,
        finish_reason=acc.finish_reason,
        cached_tokens=acc.cached_tokens,
        # The store slices stored prompt ids by prompt_len: it must be their count, or -1.
        prompt_len=len(pids) if pids is not None else -1,
        t_sent_s=t_sent,
        t_first_token_s=acc.t[0] if acc.t else math.nan,
        t_done_s=t_done,
        params=json.dumps(params, sort_keys=True),
        prompt_text=spec.prompt if isinstance(spec.prompt, str) else "",
    )


def finish(outcome: Outcome, acc: Acc, k: int, raw_logits: bool, to_ids) -> Outcome:
    """Build the token columns once per request (numpy, not per token)."""
    try:
        cols = acc.columns(k, raw_logits, to_ids)
    except (ValueError, TypeError, IndexError) as e:
        rec = outcome.record
        bad = dataclasses.replace(
            rec,
            status="error" if rec.status == "ok" else rec.status,
            error=rec.error or f"inconsistent token data: {e}",
        )
        return Outcome(bad, None, outcome.prompt_ids)
    return Outcome(outcome.record, cols, outcome.prompt_ids)
