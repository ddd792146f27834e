"""The /v1/chat/completions handlers of the reference engine's HTTP front (server.App mixes them
in): parse `messages` (chat.py), then the same engine submission, token relay and cancellation as
/v1/completions, with chat-shaped bodies and chunks."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .. import __version__
from .engine import ErrorEvent
from .protocol import BadRequest, new_id, usage
from .textstream import TextStream
from .web_errors import json_error


class ChatRoutes:
    """Needs the App's engine, executor, name, _read_json, _check_model, _submit and _tokens."""

    async def chat_completions(self, request: web.Request):
        from .chat import parse_chat

        try:
            body = await self._read_json(request)
            p = parse_chat(body, self.executor.tokenizer, self.executor.vocab_size, self.executor.max_context)
            self._check_model(p)
        except BadRequest as e:
            return web.json_response(e.body(), status=e.status)
        events = asyncio.Queue()
        req = self._submit(p, events)
        try:
            if p.stream:
                return await self._chat_stream(request, p, req, events)
            return await self._chat_collect(p, req, events)
        finally:
            self.engine.cancel(req)

    async def _chat_collect(self, p, req, events):
        from .chat import chat_logprob_entry, chat_response

        text, ids, content, finish, stop_reason = TextStream(self.executor.tokenizer, p.stop), [], [], None, None
        tok = self.executor.tokenizer
        while finish is None:
            ev = await events.get()
            if isinstance(ev, ErrorEvent):
                return json_error(500, ev.message, "server_error")
            ids.append(ev.token_id)
            text.push(ev.token_id)
            if p.logprobs is not None:
                content.append(chat_logprob_entry(ev, tok, p))
            finish = ev.finish
            if text.stop_hit:
                finish, stop_reason = "stop", text.stop_hit
                self.engine.cancel(req, "stop")
        body = chat_response(
            new_id().replace("cmpl-", "chatcmpl-"),
            self.name,
            text.text,
            content if p.logprobs is not None else None,
            finish,
            stop_reason,
            usage(len(p.prompt_ids), len(ids), req.cached_tokens_reported),
        )
        if p.return_token_ids:
            body["choices"][0].update(token_ids=ids)
            body["prompt_token_ids"] = list(p.prompt_ids)
        return web.json_response(body)

    async def _chat_stream(self, request, p, req, events):
        from .chat import chat_chunk, chat_logprob_entry

        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Server": f"tracekit/{__version__}",
            }
        )
        tok = self.executor.tokenizer
        cid, text = new_id().replace("cmpl-", "chatcmpl-"), TextStream(tok, p.stop)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            await resp.prepare(request)
            await send(chat_chunk(cid, self.name, {"role": "assistant", "content": ""}, None, None, p))
            n, finish = 0, None
            async for ev, delta, _, finish in self._tokens(req, events, text, send):
                n += 1
                lp = [chat_logprob_entry(ev, tok, p)] if p.logprobs is not None else None
                extra = {"token_ids": [ev.token_id]} if p.return_token_ids else {}
                await send(chat_chunk(cid, self.name, {"content": delta}, lp, finish, p, **extra))
            if p.include_usage and finish is not None:
                out = chat_chunk(cid, self.name, None, None, None, p)
                out["choices"], out["usage"] = [], usage(len(p.prompt_ids), n, req.cached_tokens_reported)
                await send(out)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp
