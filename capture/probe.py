"""`--dialect auto`: ask the server what it is, and record why we decided.

Probes, in order: `GET /v1/models` (owned_by says vllm / sglang / llamacpp /
tracekit; llama.cpp also sends `models[]` next to `data[]`) and `/health`
(its status is recorded), then TGI's `/info` (`model_id` + `router`),
llama.cpp's `/slots` / `/props`, SGLang's `/get_model_info`; otherwise plain
OpenAI, whose parser accepts both the legacy and the chat-style logprob shapes
(llama.cpp's `/v1` routes send the latter) and decides per response.
Whatever answers goes into the run metadata as the engine's self-report
(trimmed JSON plus `server` / `*version*` response headers).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

from tracekit.errors import CaptureError

# owned_by in /v1/models -> dialect
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "tracekit": "vllm"}


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


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict | None, dict]:
    """(status, JSON or None, version-ish headers); status -1 when unreachable."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            heads = {k.lower(): v for k, v in r.headers.items() if k.lower() == "server" or "version" in k.lower()}
            try:
                body = json.loads(await r.read())
            except ValueError:
                body = None
            return r.status, body if isinstance(body, (dict, list)) else None, heads
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return -1, {"error": f"{type(e).__name__}: {e}"}, {}


async def probe(session: aiohttp.ClientSession, base: str, dialect: str) -> ProbeResult:
    """Self-report always; the dialect decision only when `dialect` is "auto"."""
    status, models, heads = await _get(session, base + "/v1/models")
    if status == -1:
        raise CaptureError(f"{base}: server unreachable ({models['error']}); is it running and is the URL right?")
    if status in (401, 403):
        raise CaptureError(
            f"{base}/v1/models answered HTTP {status}: the server wants an API key; "
            "pass --api-key-env VAR with the key in that environment variable"
        )
    engine: dict = {"headers": heads, "v1_models_status": status}
    engine["health_status"] = (await _get(session, base + "/health"))[0]
    first = {}
    if status == 200 and isinstance(models, dict) and models.get("data"):
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
    if dialect != "auto":
        return res
    return await _decide(session, base, res, status, owned)


async def _decide(session: aiohttp.ClientSession, base: str, res: ProbeResult, status: int, owned: str):
    """The `--dialect auto` decision from engine-specific routes; fills res in place."""
    engine = res.engine
    if owned in _OWNED_BY:
        res.dialect, res.reason = _OWNED_BY[owned], f"/v1/models owned_by={owned!r}"
        if owned == "llamacpp":  # its version lives in /props
            st, body, _ = await _get(session, base + "/props")
            if st == 200 and isinstance(body, dict):
                engine["props"] = {k: body.get(k) for k in ("build_info", "total_slots", "model_path")}
        return res
    st, info, h = await _get(session, base + "/info")
    if st == 200 and isinstance(info, dict) and "model_id" in info:
        engine["info"] = {k: info.get(k) for k in ("model_id", "version", "router", "sha", "max_top_n_tokens")}
        engine["headers"].update(h)
        res.dialect, res.reason, res.model = "tgi", "/info answered with model_id (TGI)", info.get("model_id", "")
        return res
    for route in ("/slots", "/props"):
        st, body, h = await _get(session, base + route)
        if st == 200 and body is not None and (route == "/slots" or "build_info" in body):
            if isinstance(body, dict):
                engine["props"] = {k: body.get(k) for k in ("build_info", "total_slots", "model_path")}
            res.dialect, res.reason = "llamacpp", f"{route} answered (llama.cpp server)"
            return res
    st, body, h = await _get(session, base + "/get_model_info")
    if st == 200 and isinstance(body, dict) and "model_path" in body:
        engine["model_info"] = body
        res.dialect, res.reason = "sglang", "/get_model_info answered (SGLang)"
        return res
    if status != 200:
        raise CaptureError(
            f"{base}: /v1/models answered HTTP {status} and no other probe matched; pass --dialect explicitly"
        )
    res.dialect = "openai"
    res.reason = f"/v1/models answered (owned_by={owned!r}); no engine-specific route matched: plain OpenAI"
    return res
