"""The SSE server of bench/capture_bench.py, run as its own process (so the clients' CPU time is
theirs alone): pre-built vLLM-style events (top-20 "token_id:N" logprobs of a real distribution,
`token_ids`, vLLM 0.33's explicit nulls, usage, [DONE]) on three routes, one per regime:
`/v1/completions` one write an event as fast as it can (per-event), `/coalesced/...` the whole
response in one write, `/stepped/...` an engine's decode step (every STEP_S each running stream
gets its next event, all at once).

    python bench/capture_server.py PORT_FILE [--tokens N]   (writes its port to PORT_FILE)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path

TOPK = 20
STEP_S = 0.005  # the stepped regime's decode step: 64 events a step stay far below either client's capacity


def build_events(n_tokens: int, seed: int = 0) -> bytes:
    """One request's whole SSE body: n token events, a usage event, [DONE]."""
    rng = random.Random(seed)
    out = []
    for i in range(n_tokens):
        ids = rng.sample(range(32000), TOPK)
        # The top 20 of a distribution: their probabilities sum to at most 1 (a row summing above
        # it is a misreport that every check of the writer takes its slow path on).
        w = [math.exp(-rng.random() * 8) for _ in ids]
        scale = rng.uniform(0.3, 0.99) / sum(w)
        lps = sorted((math.log(x * scale) for x in w), reverse=True)
        ch = {
            "index": 0,
            "text": f" w{ids[0]}",
            "logprobs": {
                "text_offset": [i * 4],
                "token_logprobs": [lps[0]],
                "tokens": [f"token_id:{ids[0]}"],
                "top_logprobs": [{f"token_id:{t}": lp for t, lp in zip(ids, lps)}],
            },
            "finish_reason": "length" if i == n_tokens - 1 else None,
            "stop_reason": None,
            # vLLM 0.33 sends these on every chunk, null where they carry nothing: the prompt ids
            # on the first chunk only, weight versions on the last only.
            "prompt_token_ids": list(range(16)) if i == 0 else None,
            "token_ids": [ids[0]],
            "weight_versions": None,
        }
        out.append(
            {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 1,
                "model": "bench",
                "choices": [ch],
                "usage": None,
            }
        )
    out.append(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1,
            "model": "bench",
            "choices": [],
            "usage": {
                "prompt_tokens": 16,
                "completion_tokens": n_tokens,
                "total_tokens": 16 + n_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in out) + b"data: [DONE]\n\n"


def serve(port_file: str, n_tokens: int) -> None:
    from aiohttp import web

    body = build_events(n_tokens)
    # Split at event boundaries: one write per event, as an engine streams them.
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model", "owned_by": "vllm"}]})

    tick: dict = {}

    async def ticker():
        # An engine's decode step: every STEP_S each running stream gets its next event, all at once.
        loop = asyncio.get_running_loop()
        while True:
            tick["now"] = loop.create_future()
            await asyncio.sleep(STEP_S)
            tick["now"].set_result(None)

    async def completions(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if request.path.startswith("/coalesced/"):
            await resp.write(body)  # the whole response at once: one or two TCP reads client-side
        elif request.path.startswith("/stepped/"):
            for e in events:
                await tick["now"]
                await resp.write(e)
        else:
            for e in events:
                await resp.write(e)
                # Let the event go out before the next one, as an engine emits one event per
                # decode step; back-to-back writes would coalesce into a few big TCP segments.
                await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        for prefix in ("", "/coalesced", "/stepped"):
            app.router.add_get(prefix + "/v1/models", models)
            app.router.add_post(prefix + "/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        asyncio.ensure_future(ticker())
        Path(port_file).write_text(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description="the capture bench's SSE server")
    ap.add_argument("port_file")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a request")
    a = ap.parse_args()
    serve(a.port_file, a.tokens)


if __name__ == "__main__":
    main()
