"""How to make a request cold (no reused prefix) on each engine, and whether it can be done.

| engine | how | note |
|---|---|---|
| `tracekit serve` | `POST /reset_prefix_cache` | empties the cache between two engine steps |
| vLLM | `POST /reset_prefix_cache` | only with `VLLM_SERVER_DEV_MODE=1` (404 otherwise) |
| SGLang | `POST /flush_cache` | refused while requests run |
| llama.cpp | `"cache_prompt": false` (cold runs); | erase needs `--slot-save-path` (501 |
| | `POST /slots/{id}?action=erase` for | otherwise): then warm and burst runs |
| | every slot (the flush before warm and | start from what the slots hold; each |
| | burst runs) | run's reported boundary says what it had |
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
    slots: int = 0  # llama.cpp: the route holds {id}; flush POSTs it for slots 0..slots-1
    warm_body: dict = field(default_factory=dict)  # merged into primes and warm / burst runs (llama.cpp: reuse on)

    @property
    def available(self) -> bool:
        return self.route is not None or bool(self.cold_body)

    def as_dict(self) -> dict:
        return {
            "available": self.available,
            "route": self.route,
            "cold_body": self.cold_body,
            "reason": self.reason,
            "slots": self.slots,
            "flushes": self.route is not None,  # warm and burst runs start from an empty cache
        }

    def routes(self) -> list[str]:
        """The POSTs of one flush."""
        if self.route is None:
            return []
        return [self.route.format(id=i) for i in range(self.slots)] if "{id}" in self.route else [self.route]


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
        return await _llamacpp(session, base, engine)
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


LLAMA_ERASE = "/slots/{id}?action=erase"


async def _llamacpp(session: aiohttp.ClientSession, base: str, engine: dict) -> CacheControl:
    """Cold runs send cache_prompt false; a flush erases every slot where the server allows it
    (`--slot-save-path`), else warm and burst runs cannot be put at a boundary, said in `reason`."""
    cold, warm = {"cache_prompt": False}, {"cache_prompt": True}
    slots = int((engine.get("props") or {}).get("total_slots") or 0)
    ok, what = await post_flush(session, base, LLAMA_ERASE.format(id=0)) if slots else (False, "no slot count")
    if ok:
        for i in range(1, slots):
            ok, what = await post_flush(session, base, LLAMA_ERASE.format(id=i))
            if not ok:
                break
    if ok:
        return CacheControl(LLAMA_ERASE, cold, f"llama.cpp: cache_prompt=false per request; {slots} slots erased "
                            "before each warm and burst run", slots, warm)  # fmt: skip
    return CacheControl(
        None,
        cold,
        f"llama.cpp: cache_prompt=false per request (cold runs); no slot erase ({what}): warm and burst runs "
        "start from whatever the slots hold, so their reused prefix is what each run reports, not the one "
        "asked (start llama-server with --slot-save-path DIR to erase slots)",
        slots,
        warm,
    )
