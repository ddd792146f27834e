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
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tracekit.errors import ResponseShapeError, StreamProtocolError
from tracekit.schema import RequestRecord, TokenColumns, prompt_hash
from tracekit.store.rows import Row
from tracekit.text import clip

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
    # The store's checked form of exactly this outcome (postprocess.storable sets it; any new
    # Outcome starts without one): the writer appends it without checking it again.
    row: Row | None = None


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
    async for chunk in resp.content.iter_any():
        t = clock()  # one clock read per network chunk: its events arrived together
        for data in feed(chunk):
            if type(data) is not bytes:  # an event with an `event:` type
                if data.event == "error":
                    raise EngineErrorEvent(clip(f"error event: {data.data}", ERROR_EXCERPT))
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
    if dec.partial:
        raise StreamProtocolError(f"stream cut mid-event after {n} events")
    if not acc.done:
        what = "[DONE]" if dialect.done_marker else "its final event"
        raise StreamProtocolError(f"stream ended without {what} after {n} events")


ATTEMPTS = 3  # a request is sent at most this often when its connection fails before any response byte


class _NotStarted(Exception):
    """The connection failed before the response's status line and headers arrived (a kept-alive
    connection the server had closed, a reset while the body was written, a refused connect)."""


def set_keep_alive(session: aiohttp.ClientSession, on: bool) -> None:
    """Keep connections alive between requests (the default), or ask for a new connection per
    request with `Connection: close` (the server closes it after its response, so no request is
    ever written to a connection the server is about to close). probe.py decides per engine."""
    if on:
        session.headers.popall("Connection", None)
    else:
        session.headers["Connection"] = "close"


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    dialect: Dialect,
    spec: RequestSpec,
    clock: Clock,
    started: dict | None = None,
    prompt_ids: list[int] | None = None,
) -> tuple[Outcome, Acc]:
    """Send one request and return its outcome (never raises for engine or network faults;
    CancelledError propagates to the run loop).

    A request whose connection fails before any response byte arrived is sent again on a fresh
    connection, at most ATTEMPTS times in all: nothing came back, so nothing is lost by trying
    again, and a tool that measures engines must not lose requests to its own transport. The
    row's `error` then says how many attempts it took and the first failure (an `ok` row keeps
    that note). A failure after the response began is never retried: it is the engine's answer."""
    body = dialect.body(spec)
    data = json.dumps(body)
    url = base_url + dialect.route(spec.stream)
    t_sent = clock()
    if started is not None:
        started[spec.key] = t_sent
    first = ""
    for attempt in range(1, ATTEMPTS + 1):
        acc = Acc()
        try:
            if attempt == 1:
                status, http_status, error = await _exchange(session, url, data, dialect, spec, acc, clock)
            else:
                status, http_status, error = await _exchange_fresh(
                    session, url, data, dialect, spec, acc, clock, t_sent
                )
            break
        except _NotStarted as e:
            first = first or str(e)
            status, http_status, error = "error", -1, str(e)
    if attempt > 1:
        note = f"{attempt} attempts, the connection failed before any response byte; first: {clip(first, 200)}"
        error = f"{clip(error, ERROR_EXCERPT - len(note) - 3)} ({note})" if error else note
    t_done = clock()
    pids = _prompt_ids(spec, acc, prompt_ids)
    return Outcome(_record(spec, body, acc, pids, status, http_status, error, t_sent, t_done), None, pids), acc


async def _exchange_fresh(session, url, data, dialect, spec, acc, clock, t_sent) -> tuple[str, int, str]:
    """One attempt on a new connection (a one-off connector that never reuses one), with what is
    left of the request's timeout."""
    total = session.timeout.total
    left = None if total is None else total - (clock() - t_sent)
    if left is not None and left <= 0:
        return "timeout", -1, "no complete response within the timeout (retrying a failed connection)"
    timeout = aiohttp.ClientTimeout(total=left, connect=session.timeout.connect)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=session.headers, read_bufsize=1 << 18
    ) as fresh:
        return await _exchange(fresh, url, data, dialect, spec, acc, clock)


async def _exchange(session, url, data, dialect, spec, acc, clock) -> tuple[str, int, str]:
    """One attempt: (status, http_status, error). Raises _NotStarted when no response began."""
    try:
        resp = await session.post(url, data=data, headers={"Content-Type": "application/json"})
    except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
        return "timeout", -1, "no response within the timeout (0 tokens read)"
    except aiohttp.ClientConnectionError as e:
        raise _NotStarted(f"{type(e).__name__}: {e}") from e
    except aiohttp.ClientError as e:  # not a connection failure (an invalid URL, bad headers)
        return "error", -1, f"{type(e).__name__}: {e}"
    try:
        async with resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                return "error", resp.status, clip(f"HTTP {resp.status}: {text}", ERROR_EXCERPT)
            if spec.stream and resp.content_type != "application/json":
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
        return "timeout", resp.status, f"no complete response within the timeout ({len(acc.lps)} tokens read)"
    except ResponseShapeError as e:  # an explicit check in the dialect; anything else there is a bug
        return "error", resp.status, f"unexpected {dialect.name} response shape: {e}"
    except (EngineErrorEvent, StreamProtocolError) as e:
        return "error", resp.status, str(e)
    except aiohttp.ClientError as e:
        return "error", resp.status, f"{type(e).__name__}: {e}"
    return "ok", resp.status, ""


def _prompt_ids(spec: RequestSpec, acc: Acc, known: list[int] | None) -> list[int] | None:
    """Token-id prompts are their own ids; else the engine's echo; else what the run looked up."""
    if not isinstance(spec.prompt, str):
        return list(spec.prompt)
    return acc.prompt_ids if acc.prompt_ids is not None else known


def _record(spec: RequestSpec, body: dict, acc: Acc, pids, status, http_status, error, t_sent, t_done) -> RequestRecord:
    params = {k: v for k, v in body.items() if k not in ("prompt", "messages", "text", "input_ids", "inputs")}
    return RequestRecord(
        key=spec.key,
        prompt_hash=prompt_hash(spec.prompt),
        status=status,
        http_status=http_status,
        error=clip(error, ERROR_EXCERPT),
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


# ---- prompt token ids for text prompts the engine does not echo (issue 13) ---------------------
# Where a response carries the prompt's ids (vLLM's prompt_token_ids, SGLang's with
# return_prompt_token_ids), those win per row. For the others the run asks, once per distinct text
# before any request is sent: the engine's own tokenizer endpoint (exactly what it will run), else
# the local --tokenizer (may differ from the engine's), else nothing (prompt_len -1). The run
# metadata says which (`prompt_ids`).


def _ids_list(obj):
    return obj.get("tokens") if isinstance(obj, dict) else None


def _tgi_ids(obj):
    return [t.get("id") for t in obj] if isinstance(obj, list) and all(isinstance(t, dict) for t in obj) else None


# engine -> (route, body for one text, ids from the answer), read in each engine's source:
_TOKENIZE = {
    # llama.cpp 0c1e570: its completion routes tokenize with add_special and parse_special on
    # (tools/server: tokenize_input_prompts(..., true, true)); its /tokenize defaults add_special to
    # false, so both are sent. Answer {"tokens": [ids]}.
    "llamacpp": (
        "/tokenize",
        lambda text: {"content": text, "add_special": True, "parse_special": True},
        _ids_list,
    ),
    # SGLang 0.5.23: POST /tokenize (= /v1/tokenize) takes TokenizeRequest {prompt, add_special_tokens
    # (default true)} and answers TokenizeResponse {tokens, count, max_model_len}
    # (sglang/srt/entrypoints/openai/protocol.py, serving_tokenize.py); /generate encodes text with
    # the tokenizer's defaults, special tokens added (sglang/srt/managers/tokenizer_manager.py
    # _tokenize_texts), so the same ids. Only for an SGLang whose /generate does not echo them.
    "sglang": ("/tokenize", lambda text: {"prompt": text, "add_special_tokens": True}, _ids_list),
    # TGI v3.3.7 (db931fcf): POST /tokenize takes a GenerateRequest {inputs} and answers a JSON list
    # of SimpleToken {id, text, start, stop} (router/src/server.rs tokenize, encoding_to_tokens;
    # router/src/lib.rs TokenizeResponse). add_special_tokens is no request field (serde skip,
    # default true), as for /generate: the same ids. Without a fast tokenizer: 404.
    "tgi": ("/tokenize", lambda text: {"inputs": text}, _tgi_ids),
}

_ECHO = {  # dialect -> the response field that carries the prompt's ids, when the engine echoes them
    "vllm": "the response's prompt_token_ids",
    "sglang": "the response's prompt_token_ids (SGLang's return_prompt_token_ids)",
}


async def prompt_ids_for(session: aiohttp.ClientSession, base_url: str, pr, specs, tokenizer: str | None):
    """({text: ids} for the text prompts of `specs`, the source said in the run metadata's
    `prompt_ids`). `pr` is the probe's result (its dialect and engine). Never raises for the
    engine's answers: an endpoint that fails falls back to the tokenizer, then to nothing."""
    texts = [s.prompt for s in specs if isinstance(s.prompt, str)]
    if not texts:
        return {}, "the prompts are token ids"
    if pr.dialect == "vllm":  # vLLM and tracekit serve echo them (return_token_ids)
        return {}, _ECHO["vllm"]
    if pr.dialect == "openai-chat":  # the engine wraps the text in its chat template: not these ids
        return {}, "unknown: chat messages go through the engine's chat template"
    ids, source = await _ids_for_texts(session, base_url, pr.engine_kind, texts, tokenizer)
    if pr.dialect in _ECHO:  # SGLang: the echo where the engine sends it, the look-up where not
        return ids, f"{_ECHO[pr.dialect]}; where an answer lacks them, {source}"
    return ids, source


async def _ids_for_texts(session, base_url: str, engine: str, texts: list[str], tokenizer: str | None):
    texts = sorted(set(texts))
    how = _TOKENIZE.get(engine)
    failed = ""
    if how is not None:
        route, body, ids_of = how
        out = {}
        for text in texts:
            status = -1
            try:
                async with session.post(base_url + route, json=body(text)) as r:
                    status = r.status
                    obj = await r.json(content_type=None) if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                obj = None
            ids = ids_of(obj) if obj is not None else None
            if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                said = {200: "answered without ids", -1: "did not answer"}.get(status, f"answered HTTP {status}")
                failed = f" (the engine's {route} {said})"
                break
            out[text] = ids
        else:
            return out, f"the engine's {route} (the ids it runs), for text prompts it does not echo"
    if tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
        out = {t: tok.encode(t, add_special_tokens=True).ids for t in texts}
        return out, f"the local tokenizer {tokenizer} (may differ from the engine's), for text prompts{failed}"
    return {}, f"unknown for text prompts (the engine does not echo them; pass --tokenizer DIR){failed}"


class RouteWatch:
    """Says, once, when the first answers of a run are all HTTP 404: the dialect's route does not
    exist on this server, so the dialect looks wrong (`--dialect` given by hand, or a URL with a
    path). The run goes on (every row keeps its 404); the line goes to stderr at once."""

    def __init__(self, dialect: Dialect, after: int = 3, out=None):
        self.dialect, self.after, self.out = dialect, after, out
        self.n = 0
        self.said = ""

    def seen(self, rec: RequestRecord) -> None:
        if self.n < 0:
            return
        if rec.http_status != 404:
            self.n = -1  # something else answered: the route exists
            return
        self.n += 1
        if self.n == self.after:
            route = self.dialect.route(True)
            first = "the first request" if self.n == 1 else f"the first {self.n} requests all"
            self.said = (
                f"warning: {first} answered HTTP 404 on {route}: the dialect "
                f"{self.dialect.name!r} looks wrong for this server; try --dialect auto, or another --dialect"
            )
            print(self.said, file=self.out or sys.stderr)
