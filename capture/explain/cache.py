"""How to make a request cold (no reused prefix) on each engine, and whether it can be done.

| engine | how | note |
|---|---|---|
| `tracekit serve` | `POST /reset_prefix_cache` | empties the cache between two engine steps |
| vLLM | `POST /reset_prefix_cache` | only with `VLLM_SERVER_DEV_MODE=1` (404 otherwise) |
| SGLang | `POST /flush_cache` | refused while requests run |
| llama.cpp | `"cache_prompt": false` in the request body | per request, no route |
| TGI, others | none known | the cold variant is unavailable |

The flush is tried once when the run starts (an empty cache costs nothing
then); a route that answers 404 or an error makes the cold variant
unavailable, with the reason in the trace's run metadata and the report.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

ROUTES = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}
VLLM_NOTE = "vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 in its environment"


@dataclass(frozen=True)
class CacheControl:
    """`route`: POST it to flush (None: no route); `cold_body`: merged into a request to make it
    cold (llama.cpp). `available` is False when neither works; `reason` says what was found."""

    route: str | None
    cold_body: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.route is not None or bool(self.cold_body)

    def as_dict(self) -> dict:
        return {"available": self.available, "route": self.route, "cold_body": self.cold_body, "reason": self.reason}


async def post_flush(session: aiohttp.ClientSession, base: str, route: str) -> tuple[bool, str]:
    """(ok, what happened). Never raises for network or HTTP errors."""
    try:
        # An empty JSON object as the body: the routes take none, and some servers refuse an empty body.
        async with session.post(base + route, json={}, timeout=aiohttp.ClientTimeout(total=60)) as r:
            text = (await r.text(errors="replace"))[:200]
            return r.status == 200, f"POST {route}: HTTP {r.status} {text.strip()}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return False, f"POST {route}: {type(e).__name__}: {e}"


async def detect(session: aiohttp.ClientSession, base: str, dialect: str, engine: dict) -> CacheControl:
    """The engine's way to start cold, found by trying it."""
    if dialect == "llamacpp":
        return CacheControl(None, {"cache_prompt": False}, "llama.cpp: cache_prompt=false per request")
    owned = str(((engine.get("v1_models") or {}).get("owned_by")) or "")
    tried = []
    for route in dict.fromkeys([ROUTES.get(dialect), *ROUTES.values()]):
        if route is None:
            continue
        ok, what = await post_flush(session, base, route)
        if ok:
            return CacheControl(route, {}, what)
        tried.append(what)
    note = f"; {VLLM_NOTE}" if dialect == "vllm" and owned != "tracekit" else ""
    return CacheControl(None, {}, "no cache flush: " + "; ".join(tried) + note)
