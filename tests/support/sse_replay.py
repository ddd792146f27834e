"""One request through tracekit's real capture client against an aiohttp server on 127.0.0.1 that
writes the given SSE bytes (the dialect tests' edge cases: CRLF events, -Infinity, the json
fallback). Imports lazily, so a caller may hide orjson first."""

from __future__ import annotations


def capture_stream(parts: list[bytes], top: int, dialect: str = "vllm"):
    """(outcome, acc) of one streamed completion whose body is `parts`, written as they are."""
    import asyncio

    from aiohttp import web

    from tracekit.capture.client import Clock, make_session, send
    from tracekit.capture.dialects import RequestSpec, get

    async def main():
        async def completions(request):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for part in parts:
                await resp.write(part)
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with make_session(1, 10.0) as s:
                spec = RequestSpec("k", [1, 2], 3, top, False, True)
                return await send(s, f"http://127.0.0.1:{port}", get(dialect), spec, Clock())
        finally:
            await runner.cleanup()

    return asyncio.run(main())
