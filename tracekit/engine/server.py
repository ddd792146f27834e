"""The HTTP front of the reference engine (aiohttp): /v1/completions, /v1/chat/completions, /health,
/v1/models, /metrics,
POST /reset_prefix_cache and, with an injected fault, /fault_log.

The server listens before the model is loaded (/health answers 503 until it
is), then hands every request to the engine's owner loop and relays its
events. A client that disconnects cancels its handler (aiohttp
`handler_cancellation`), and the `finally` releases the slot at once; a write
that races the disconnect ends the handler quietly.

Hostile input stays at the edge: a body over MAX_BODY_BYTES, JSON nested too
deep, text that is not Unicode, out-of-range numbers get 400 before anything
reaches the engine; a client that sends its first request's headers or its
body slower than `read_timeout_s` is cut off (connections.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

from aiohttp import web

from .. import __version__
from ..errors import EngineError
from .chat_routes import ChatRoutes
from .connections import exposure_warning, listen
from .engine import ErrorEvent, GenRequest
from .protocol import (
    BadRequest,
    LogprobsBuilder,
    envelope,
    error_body,
    new_id,
    parse_completion,
    prompt_logprobs_list,
    usage,
)
from .textstream import TextStream
from .web_errors import json_error

MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    dtype: str = "fp32"
    attn: str = "sdpa"
    slots: int = 4
    max_context: int | None = None
    block_size: int = 16
    prefix_cache: bool = True
    cache_blocks: int = 4096
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    api_key: str | None = None
    fault: str | None = None
    served_name: str | None = None
    threads: int = 0
    prefill_chunk: int = 0
    batch_invariant: bool = False  # decode rows one by one, one prefill forward per block
    eager_decode: bool = False  # no CUDA graphs for decode steps (stepgraph.py; bitwise either way)
    unfused: bool = False  # no fused QKV / gate-up GEMMs (fuse.py; used only where bitwise anyway)
    read_timeout_s: float = 30.0  # first request's headers, and each request body, must arrive within this


class App(ChatRoutes):
    """The routes; /v1/chat/completions' handlers are ChatRoutes' (chat_routes.py)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg, self.engine, self.executor, self.loop = cfg, None, None, None
        self.name = cfg.served_name or os.path.basename(os.path.normpath(cfg.model_dir))
        self.started = int(time.time())

    # ---- lifecycle -------------------------------------------------------------------------
    def load(self) -> None:
        """Build the model executor and engine (blocking; run in a worker thread)."""
        import torch

        from .engine import Engine
        from .executor import ModelExecutor
        from .faults import parse_fault
        from .faults_hooks import engine_fault
        from .prefix_cache import PrefixCache

        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        if not sys.stderr.isatty():  # no progress bars in logs
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        c = self.cfg
        self.executor = ModelExecutor(
            c.model_dir,
            c.dtype,
            c.attn,
            c.device,
            c.slots,
            c.max_context,
            batch_invariant=c.batch_invariant,
            decode_graphs="eager" if c.eager_decode else None,
            fuse_projections=False if c.unfused else None,
        )
        fault = parse_fault(c.fault)
        cache = PrefixCache(c.block_size, c.cache_blocks, fault) if c.prefix_cache else None
        self.executor.fault = hooks = engine_fault(fault)  # None unless an executor/engine fault
        self.engine = Engine(
            self.executor,
            cache,
            post=self.loop.call_soon_threadsafe,
            threads=c.threads,
            prefill_chunk=c.prefill_chunk,
            fault=hooks,
            invariant_block=c.block_size if c.batch_invariant else 0,
        )
        self.engine.start()

    def meta(self) -> dict:
        from .faults import parse_fault
        from .kernels import describe as describe_kernels
        from .memory import memory_report

        r, c = self.executor, self.cfg
        return {
            "engine": "tracekit",
            "version": __version__,
            "eos_token_ids": r.eos_ids,
            "vocab_size": r.vocab_size,
            "dtype": c.dtype,
            "logits_dtype": c.dtype,
            "attn": c.attn,
            "device": c.device,
            "max_context": r.max_context,
            "slots": c.slots,
            "block_size": c.block_size,
            "prefix_cache": c.prefix_cache,
            "prefill_chunk": c.prefill_chunk,
            "batch_invariant": c.batch_invariant,
            "inject_fault": parse_fault(c.fault).name if c.fault else None,  # the canonical spelling
            "model_type": r.model_type,
            "model_dir": os.path.abspath(c.model_dir),
            "max_logprobs": 20,
            "attn_kernels": describe_kernels(r.device, r.allow_cudnn),
            "decode_graphs": r.graph_report(),  # per batch size: graphed or eager (and why)
            **memory_report(r),  # kv_bytes_per_slot (from the config), weights, device peak
        }

    # ---- middleware -------------------------------------------------------------------------
    OPEN_PATHS = ("/health", "/metrics")  # readiness and monitoring need no key

    @web.middleware
    async def guard(self, request: web.Request, handler):
        if self.cfg.api_key and request.path not in self.OPEN_PATHS:
            want = f"Bearer {self.cfg.api_key}".encode()
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), want):
                return json_error(401, "invalid or missing API key", "authentication_error")
        if request.path not in self.OPEN_PATHS and self.engine is None:
            return json_error(503, "model is loading", "service_unavailable")
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            if e.status == 413:
                return json_error(400, f"request body is larger than {MAX_BODY_BYTES} bytes")
            return json_error(e.status, e.reason)
        resp.headers["Server"] = f"tracekit/{__version__}"
        return resp

    # ---- routes ------------------------------------------------------------------------------
    async def health(self, request):
        if self.engine is None:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request):
        card = {
            "id": self.name,
            "object": "model",
            "created": self.started,
            "owned_by": "tracekit",
            "root": os.path.abspath(self.cfg.model_dir),
            "max_model_len": self.executor.max_context,
            "meta": self.meta(),
        }
        return web.json_response({"object": "list", "data": [card]})

    async def fault_log(self, request):
        """Every application of the injected fault (only with --inject-fault): which prompt, how
        many cached KV values it served and how many it actually changed. The family's executor and
        engine kinds (faults_hooks.py) report only how many times they changed something."""
        if self.engine is None:
            return json_error(503, "model is loading", "service_unavailable")
        cache, hooks = self.engine.cache, self.engine.fault
        if self.cfg.fault is not None and hooks is not None:
            return web.json_response({"fault": self.cfg.fault, "applied_total": hooks.applied, "records": []})
        if self.cfg.fault is None or cache is None:
            return json_error(404, "no fault injected (start with --inject-fault)", "not_found_error")
        total, recs = cache.fault_log.snapshot()
        return web.json_response(
            {"fault": self.cfg.fault, "applied_total": total, "records": [dataclasses.asdict(r) for r in recs]}
        )

    async def metrics(self, request):
        from .metrics import render

        return web.Response(text=render(self.engine, self.cfg), content_type="text/plain")

    async def reset_prefix_cache(self, request):
        """Empty the prefix cache (vLLM's route name), between two engine steps; running requests
        keep their own KV. Answers how many blocks were dropped."""
        cache = self.engine.cache
        dropped = await asyncio.wrap_future(self.engine.call(cache.clear if cache is not None else lambda: 0))
        return web.json_response({"status": "ok", "blocks_dropped": dropped, "prefix_cache": cache is not None})

    async def _read_json(self, request: web.Request):
        """The request body as JSON, or BadRequest (413 for size, 408 for a slow body)."""
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.read_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"request body not received within {self.cfg.read_timeout_s:g} s", status=408) from None
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413) from None
        except ConnectionError:
            # The client left before its body was read (in Python 3.11 wait_for can surface this
            # instead of the handler's cancellation): nobody is there to answer.
            raise BadRequest("client closed the connection before sending its body", status=499) from None
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
        except RecursionError:
            raise BadRequest("malformed JSON body: nested too deeply") from None

    def _check_model(self, p) -> None:
        """An unknown `model` is refused as OpenAI does (404, code model_not_found); none = the served one."""
        if p.model is not None and p.model != self.name:
            raise BadRequest(
                f"The model `{p.model}` does not exist (this server serves `{self.name}`).",
                "model",
                status=404,
                code="model_not_found",
            )

    def _submit(self, p, events) -> GenRequest:
        req = GenRequest(
            prompt_ids=list(p.prompt_ids),
            max_tokens=p.max_tokens,
            logprobs=p.logprobs or 0,
            temperature=p.temperature,
            seed=p.seed,
            ignore_eos=p.ignore_eos,
            prompt_logprobs=p.prompt_logprobs,
            forced=p.forced,
            emit=events.put_nowait,
        )
        self.engine.submit(req)
        return req

    async def completions(self, request: web.Request):
        try:
            body = await self._read_json(request)
            p = parse_completion(body, self.executor.tokenizer, self.executor.vocab_size, self.executor.max_context)
            self._check_model(p)
        except BadRequest as e:
            resp = web.json_response(e.body(), status=e.status)
            if e.status == 408:  # a client too slow to send its body: do not wait for the rest
                resp.force_close()
            return resp
        events = asyncio.Queue()
        req = self._submit(p, events)
        try:
            if p.stream:
                return await self._stream(request, p, req, events)
            return await self._collect(p, req, events)
        finally:
            self.engine.cancel(req)  # no-op once finished; frees the slot on disconnect or stop string

    def _token_str(self, p):
        if p.tokens_as_ids:
            return lambda t: f"token_id:{t}"
        return lambda t: self.executor.tokenizer.decode([t])

    async def _collect(self, p, req, events):
        text, lp = TextStream(self.executor.tokenizer, p.stop), LogprobsBuilder(p, self._token_str(p))
        ids, finish, stop_reason, want_lp = [], None, None, self._want_lp(p)
        while finish is None:
            ev = await events.get()
            if isinstance(ev, ErrorEvent):
                return json_error(500, ev.message, "server_error")
            ids.append(ev.token_id)
            if want_lp or p.stop:  # per-token text only when offsets or stop strings need it
                _, off = text.push(ev.token_id)
                if want_lp:
                    lp.add(ev, off)
            finish = ev.finish  # EOS or length: stop_reason stays None, as in vLLM
            if text.stop_hit:
                finish, stop_reason = "stop", text.stop_hit
                self.engine.cancel(req, "stop")
        out_text = text.text if (want_lp or p.stop) else self.executor.tokenizer.decode(ids, skip_special_tokens=True)
        choice = {
            "index": 0,
            "text": out_text,
            "logprobs": lp.build() if want_lp else None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        if p.return_token_ids:
            choice.update(token_ids=ids, prompt_token_ids=list(p.prompt_ids))
        if p.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_list(p, req.prompt_rows, len(p.prompt_ids), self._token_str(p))
        return web.json_response(
            envelope(new_id(), self.name, [choice], usage(len(p.prompt_ids), len(ids), req.cached_tokens_reported))
        )

    @staticmethod
    def _want_lp(p) -> bool:
        return p.logprobs is not None or p.raw_logits

    async def _stream(self, request, p, req, events):
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Server": f"tracekit/{__version__}",
            }
        )
        cid, text = new_id(), TextStream(self.executor.tokenizer, p.stop)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            await resp.prepare(request)
            await self._relay(resp, p, req, events, cid, text, send)
        except ConnectionResetError:
            # The client went away while we wrote ("Cannot write to closing transport"): the same
            # as a disconnect between two writes; `completions` frees the slot. No traceback.
            pass
        return resp

    async def _tokens(self, req, events, text, send):
        """The streamed routes' one loop: each generated token as (event, text delta, its offset,
        finish or None); a stop string cancels the request and ends the stream, the last delta
        carries the flushed text; an engine error is sent as an error body and ends it."""
        finish = None
        while finish is None:
            ev = await events.get()
            if isinstance(ev, ErrorEvent):
                await send(error_body(ev.message, "server_error"))
                return
            delta, off = text.push(ev.token_id)
            finish = "stop" if text.stop_hit else ev.finish
            if text.stop_hit:
                self.engine.cancel(req, "stop")
            if finish:
                delta += text.flush()
            yield ev, delta, off, finish

    async def _relay(self, resp, p, req, events, cid, text, send) -> None:
        n = 0

        def chunk(delta: str, finish=None, stop_reason=None, ev=None, off=0) -> dict:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
            if ev is not None and self._want_lp(p):
                lp = LogprobsBuilder(p, self._token_str(p))
                lp.add(ev, off)
                c["logprobs"] = lp.build()
            if p.return_token_ids:
                c["token_ids"] = [ev.token_id] if ev is not None else []
                if n == 1 and ev is not None:
                    c["prompt_token_ids"] = list(p.prompt_ids)
            out = envelope(cid, self.name, [c])
            if p.include_usage:
                out["usage"] = None
            return out

        finish = None
        async for ev, delta, off, finish in self._tokens(req, events, text, send):
            n += 1
            await send(chunk(delta, finish, text.stop_hit, ev, off))
        if p.include_usage and finish is not None:
            await send(envelope(cid, self.name, [], usage(len(p.prompt_ids), n, req.cached_tokens_reported)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


def build_app(app: App) -> web.Application:
    web_app = web.Application(client_max_size=MAX_BODY_BYTES + 1, middlewares=[app.guard])
    web_app.router.add_get("/health", app.health)
    web_app.router.add_get("/v1/models", app.models)
    web_app.router.add_get("/metrics", app.metrics)
    web_app.router.add_get("/fault_log", app.fault_log)
    web_app.router.add_post("/v1/completions", app.completions)
    web_app.router.add_post("/v1/chat/completions", app.chat_completions)
    web_app.router.add_post("/reset_prefix_cache", app.reset_prefix_cache)
    return web_app


async def serve(cfg: ServeConfig) -> None:
    """Listen, announce the address on stderr, load the model, serve until SIGINT/SIGTERM."""
    app = App(cfg)
    app.loop = asyncio.get_running_loop()
    # The owner thread is Python-bound at small model sizes; with the default 5 ms GIL switch
    # interval the HTTP thread waits whole intervals to hand over each step's events.
    sys.setswitchinterval(0.0005)
    runner = web.AppRunner(build_app(app), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        server = await listen(runner.server, cfg.host, cfg.port, cfg.read_timeout_s)
    except OSError as e:
        await runner.cleanup()
        raise EngineError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}; pick another --port") from None
    host, port = server.sockets[0].getsockname()[:2]
    # The launcher (tracekit.engine.process) parses this exact line.
    print(f"tracekit serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    warning = exposure_warning(cfg.host, cfg.api_key is not None)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.to_thread(app.load)
        print(
            f"tracekit serve: model {app.name} loaded ({cfg.dtype}, {cfg.attn}, {cfg.slots} slots)",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    finally:
        server.close()
        if app.engine is not None:
            app.engine.stop()
        await runner.cleanup()
