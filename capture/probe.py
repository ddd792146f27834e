"""`--dialect auto`: ask the server what it is, and record why we decided.

Probes, in order: `GET /v1/models` (owned_by says vllm / sglang / llamacpp /
tracekit; llama.cpp also sends `models[]` next to `data[]`) and `/health`
(its status is recorded), then TGI's `/info` (`model_id` + `router`),
llama.cpp's `/slots` / `/props`, SGLang's `/model_info` (`/get_model_info`); otherwise plain
OpenAI, whose parser accepts both the legacy and the chat-style logprob shapes
(llama.cpp's `/v1` routes send the latter) and decides per response.
Whatever answers goes into the run metadata as the engine's self-report
(trimmed JSON plus `server` / `*version*` response headers).

Before deciding it waits for the engine, when asked (`wait_ready_s`): an
engine still loading answers 503 (llama.cpp, SGLang) or does not listen yet
(vLLM, TGI). It also sets the run's keep-alive policy for the engine
(`KEEP_ALIVE`, see docs/capture.md "Connections") and warns when an explicit
`--dialect` disagrees with what the server says it is. It does not send any
generation request.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from tracekit.errors import CaptureError, UsageError
from tracekit.text import clip

from .client import set_keep_alive

# owned_by in /v1/models -> dialect
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "tracekit": "vllm"}

# Keep-alive per engine (the dialect the probe decided, or was given), from evidence
# (docs/capture.md "Connections"). Off: a new connection per request (`Connection: close`).
KEEP_ALIVE = {
    "llamacpp": (
        False,
        "llama-server closes the connection after every streamed response although it answers "
        "'Keep-Alive: timeout=5, max=100': a client that reuses it first loses the request (45 of 960 "
        "in 60 captures, scripts/llama_soak.py --mode before); a new connection per request: 0 of 960",
    ),
}
_KEEP_ALIVE_DEFAULT = (
    True,
    "kept alive (the engine keeps streamed connections open); a request whose connection fails "
    "before any response byte is retried on a fresh one",
)

POLL_S = 0.5  # how often a not-ready engine is asked again (--wait-ready)

# Sampling penalties sent neutral with every request, per engine (a prompt's own fields win): a
# penalty moves the chosen token off the argmax of the logits the engine reports. llama-server
# takes its defaults from its command line (--repeat-penalty, --dry-multiplier, ...), which a
# request's fields override (tools/server/server-schema.cpp); llama-cpp-python's server applies
# repeat_penalty 1.1 by default (llama_cpp/server/types.py repeat_penalty_field): 12/12 pairs
# unexplained against llama-server until 1.0 was sent (issue 24).
NEUTRAL_PENALTIES = {
    "llamacpp": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0},
    "llama-cpp-python": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
}


@dataclass
class ProbeResult:
    dialect: str
    reason: str
    engine: dict = field(default_factory=dict)
    model: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    raw_logits: bool = False
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    tokenizer: str = ""  # a tokenizer dir the engine reported
    warnings: list[str] = field(default_factory=list)  # one line each, printed on stderr and kept in run.engine
    engine_kind: str = ""  # the engine behind the server (llamacpp also through its /v1 routes)


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict | None, dict]:
    """(status, JSON or None, version-ish headers); status -1 when unreachable. A connection that
    fails before any response byte (a kept-alive one the server closed) is tried once more on a
    fresh connection, as requests are (client.send)."""
    for attempt in (1, 2):
        try:
            if attempt == 1:
                return await _get_once(session, url)
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), headers=session.headers
            ) as fresh:
                return await _get_once(fresh, url)
        except asyncio.TimeoutError as e:  # before ClientError: aiohttp's timeouts are both
            return -1, {"error": f"{type(e).__name__}: no answer within 10 s"}, {}
        except aiohttp.ClientConnectionError as e:
            err = e
        except aiohttp.ClientError as e:
            return -1, {"error": f"{type(e).__name__}: {e}"}, {}
    return -1, {"error": f"{type(err).__name__}: {err}"}, {}


async def _get_once(session: aiohttp.ClientSession, url: str) -> tuple[int, dict | None, dict]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        heads = {k.lower(): v for k, v in r.headers.items() if k.lower() == "server" or "version" in k.lower()}
        try:
            body = json.loads(await r.read())
        except ValueError:
            body = None
        return r.status, body if isinstance(body, (dict, list)) else None, heads


def check_base_url(base: str) -> None:
    """`--http` is the server's root: tracekit adds every route (`/v1/models`, `/completion`, ...)."""
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--http {base}: give the server's root URL, e.g. http://127.0.0.1:8000")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        root = base[: base.rstrip("/").rfind("/v1")]
        raise UsageError(f"--http {base}: drop the trailing /v1 (tracekit adds the routes itself): --http {root}")


async def wait_ready(session: aiohttp.ClientSession, base: str, wait_s: float) -> tuple[int, dict | None, dict]:
    """GET /v1/models until the engine is ready: an answer other than 503 (an engine still loading
    answers 503) and, with `wait_s` > 0, a listening socket. Gives up after `wait_s` seconds with
    one line that says the engine is not ready (never the dialect advice a 503 used to get)."""
    deadline = time.monotonic() + wait_s
    while True:
        status, models, heads = await _get(session, base + "/v1/models")
        if status not in (-1, 503):
            return status, models, heads
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    if status == -1:
        waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
        hint = "" if wait_s > 0 else "; if it is starting, pass --wait-ready SECONDS"
        raise CaptureError(
            f"{base}: server unreachable{waited} ({models['error']}); is it running and is the URL right{hint}?"
        )
    said = _error_text(models)
    waited = f"still answers HTTP 503 after {wait_s:g} s" if wait_s > 0 else "answered HTTP 503"
    hint = "wait for it or pass a longer --wait-ready SECONDS" if wait_s > 0 else "pass --wait-ready SECONDS to wait"
    raise CaptureError(f"{base}: the engine is not ready ({waited} on /v1/models{said}); {hint}")


def _error_text(body: dict | None) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    return f": {clip(str(msg), 120)}" if msg else ""


async def probe(session: aiohttp.ClientSession, base: str, dialect: str, wait_ready_s: float = 0.0) -> ProbeResult:
    """Self-report always; the dialect decision when `dialect` is "auto" (with an explicit
    dialect the decision is still made, to warn when the two disagree). Sets the session's
    keep-alive policy for the engine."""
    check_base_url(base)
    # A new connection for each probe: none of them is left in the pool for the first request
    # to reuse on an engine that does not keep connections alive.
    set_keep_alive(session, False)
    status, models, heads = await wait_ready(session, base, wait_ready_s)
    if status in (401, 403):
        raise CaptureError(
            f"{base}/v1/models answered HTTP {status}: the server wants an API key; "
            "pass --api-key-env VAR with the key in that environment variable"
        )
    engine: dict = {"headers": heads, "v1_models_status": status}
    engine["health_status"] = (await _get(session, base + "/health"))[0]
    first = {}
    if status == 200 and isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0] if isinstance(models["data"][0], dict) else {}
        engine["v1_models"] = {
            k: first.get(k) for k in ("id", "owned_by", "root", "max_model_len", "meta") if k in first
        }
    meta = first.get("meta") if isinstance(first.get("meta"), dict) else {}
    res = ProbeResult(
        dialect,
        "given with --dialect",
        engine,
        str(first.get("id", "")),
        [int(t) for t in meta.get("eos_token_ids") or []],
        first.get("owned_by") == "tracekit",
    )
    owned = str(first.get("owned_by", "")).lower()
    if owned == "tracekit":
        # The reference engine: raw top-k logits on request, and its model dir holds the tokenizer.
        res.extra_body = {"return_raw_logits": True}
        res.tokenizer = str(meta.get("model_dir") or "")
    if dialect == "auto":
        await _decide(session, base, res, status, owned)
    else:
        seen = ProbeResult("auto", "", {"headers": {}})
        try:
            await _decide(session, base, seen, status, owned)
        except CaptureError:
            seen.dialect = ""
        if seen.dialect and seen.dialect != dialect and not _compatible(dialect, seen.dialect):
            res.warnings.append(
                f"--dialect {dialect}, but the server looks like {seen.dialect} ({seen.reason}); "
                "if every request fails (HTTP 404), try --dialect auto"
            )
        res.engine.update({k: v for k, v in seen.engine.items() if k not in res.engine})
    _keep_alive(session, res)
    neutral = NEUTRAL_PENALTIES.get(res.engine_kind, {})
    if neutral:
        res.extra_body = {**neutral, **res.extra_body}
        res.engine["neutral_penalties"] = neutral  # recorded: what every request sends unless a prompt says otherwise
    res.engine["warnings"] = res.warnings
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return res


def _compatible(given: str, seen: str) -> bool:
    """Dialects that work on the server the probe saw (its OpenAI routes take the openai dialects)."""
    return given in ("openai", "openai-chat") and seen in ("vllm", "sglang", "llamacpp", "openai")


def _keep_alive(session: aiohttp.ClientSession, res: ProbeResult) -> None:
    res.engine_kind = _engine_of(res)
    on, why = KEEP_ALIVE.get(res.engine_kind, _KEEP_ALIVE_DEFAULT)
    set_keep_alive(session, on)
    res.engine["keep_alive"] = {"on": on, "why": why}


def _engine_of(res: ProbeResult) -> str:
    """The engine behind the server, whatever dialect talks to it ("llamacpp" for llama-server
    also when captured through its /v1 routes)."""
    owned = str(res.engine.get("v1_models", {}).get("owned_by", "")).lower()
    if owned == "llamacpp" or "props" in res.engine:
        return "llamacpp"
    if "info" in res.engine:  # TGI's /info answered; its /v1/models says owned_by = the model id
        return "tgi"
    if owned == "me" and str(res.engine.get("headers", {}).get("server", "")).lower().startswith("uvicorn"):
        # llama-cpp-python's server: ModelData owned_by "me", served by uvicorn (llama_cpp/server/app.py)
        return "llama-cpp-python"
    return owned if owned in _OWNED_BY else res.dialect


_PENALTY_DEFAULTS = ("repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "dry_multiplier")


def _props(body: dict) -> dict:
    """llama.cpp's /props: version, slots, model, and the server's default sampling penalties
    (`default_generation_settings.params`: what a request that names none gets)."""
    out = {k: body.get(k) for k in ("build_info", "total_slots", "model_path")}
    params = (body.get("default_generation_settings") or {}).get("params") or {}
    if isinstance(params, dict):
        out["default_penalties"] = {k: params[k] for k in _PENALTY_DEFAULTS if k in params}
    return out


async def _decide(session: aiohttp.ClientSession, base: str, res: ProbeResult, status: int, owned: str):
    """The `--dialect auto` decision from engine-specific routes; fills res in place."""
    engine = res.engine
    if owned in _OWNED_BY:
        res.dialect, res.reason = _OWNED_BY[owned], f"/v1/models owned_by={owned!r}"
        if owned == "llamacpp":  # its version lives in /props
            st, body, _ = await _get(session, base + "/props")
            if st == 200 and isinstance(body, dict):
                engine["props"] = _props(body)
        return res
    st, info, h = await _get(session, base + "/info")
    if st == 200 and isinstance(info, dict) and "model_id" in info:
        # TGI's Info has no max_top_n_tokens (nor model_dtype): router/src/lib.rs at v3.3.7; the
        # top-n limit is asked with a request instead (http._tgi_top_n).
        engine["info"] = {k: info.get(k) for k in ("model_id", "version", "router", "sha")}
        engine["headers"].update(h)
        res.dialect, res.reason, res.model = "tgi", "/info answered with model_id (TGI)", info.get("model_id", "")
        return res
    for route in ("/slots", "/props"):
        st, body, h = await _get(session, base + route)
        if st == 200 and body is not None and (route == "/slots" or "build_info" in body):
            if isinstance(body, dict):
                engine["props"] = _props(body)
            res.dialect, res.reason = "llamacpp", f"{route} answered (llama.cpp server)"
            return res
    # SGLang: /model_info, and /get_model_info, its deprecated alias that older versions have alone
    # (sglang/srt/entrypoints/http_server.py, 0.5.23).
    for route in ("/model_info", "/get_model_info"):
        st, body, h = await _get(session, base + route)
        if st == 200 and isinstance(body, dict) and "model_path" in body:
            engine["model_info"] = body
            res.dialect, res.reason = "sglang", f"{route} answered (SGLang)"
            return res
    if status != 200:
        raise CaptureError(
            f"{base}: /v1/models answered HTTP {status} and no engine-specific route answered: "
            "is this the server's root URL (no path after HOST:PORT)? If it is, pass --dialect explicitly"
        )
    res.dialect = "openai"
    res.reason = f"/v1/models answered (owned_by={owned!r}); no engine-specific route matched: plain OpenAI"
    return res
