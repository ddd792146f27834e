"""A transcript-replaying aiohttp server on 127.0.0.1:0, for the capture tests.

It serves recorded (or constructed) responses from fixtures/transcripts/,
re-chunked at seeded random byte boundaries so SSE events and UTF-8
characters split across network reads, and injects faults chosen by the
prompt text: a prompt "FAULT:<kind>" gets that fault (so faults hit the same
request whatever the concurrency). Kinds: 500, cut (connection closed
mid-event, chunked body unfinished), cleancut (body ends cleanly in the middle
of an event), nodone (no end marker), badjson, badshape (valid JSON of an unknown
shape), errorevent, stall (half the body, then nothing until the server stops, or
for `stall_s` seconds), reset (TCP RST), badfinish (a finish reason over 16 bytes, not
ASCII), surrogate (an error event whose message holds a lone surrogate), longerror (an error event
with 809 characters of words), 400 (a
refused request), drop (the connection closed before any response byte, the first
time this prompt text arrives: its retry is served), dropall (the same, every
time), closeafter (this connection closed right after its response, keep-alive
promised: the next request written to it may be lost and retried), slow (the body
in pieces `slow_s` apart). Text after the kind ("FAULT:drop k17") makes prompts
distinct.

Server-wide faults (constructor options): `drop_kept_alive` closes a kept-alive
connection when the next request arrives on it, before any response byte (what a
server that closes idle or used-up connections does to a client that reuses one
at the same moment: the race of issue 13, made deterministic, so every reused
connection loses its request); `close_after_response` closes every connection
right after its response without saying so (no `Connection: close`), as
llama-server does after each streamed response: a client that reuses the
connection before it reads the FIN loses the request (a race, so tests assert
only what holds either way); `not_ready` answers that many requests with 503
"Loading model" first, as llama.cpp does while it loads.

The server runs in its own thread and event loop, as a real separate server.
Tests wait on what it saw (`wait_requests`), never on time.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

TRANSCRIPTS = Path(__file__).resolve().parents[2] / "fixtures" / "transcripts"


@dataclass(frozen=True)
class Transcript:
    method: str
    path: str
    request: bytes
    status: int
    headers: dict
    body: bytes

    def events(self) -> list[bytes]:
        """The SSE body split into events (each with its blank-line terminator)."""
        parts = self.body.split(b"\n\n")
        return [p + b"\n\n" for p in parts if p.strip()]


def _dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while i < len(data):
        j = data.index(b"\r\n", i)
        size = int(data[i:j], 16)
        if size == 0:
            break
        out += data[j + 2 : j + 2 + size]
        i = j + 2 + size + 2
    return out


def load(name: str) -> Transcript:
    raw = (TRANSCRIPTS / name).read_bytes()
    head, resp = raw.split(b"\n### response\n", 1)
    lines = head.split(b"\n", 3)
    method, path = lines[1].decode().split(" ", 1)
    status_head, body = resp.split(b"\r\n\r\n", 1)
    hl = status_head.decode("latin-1").split("\r\n")
    status = int(hl[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in hl[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Transcript(method, path, lines[2] if len(lines) > 2 else b"", status, headers, body)


def _prompt_text(body: dict) -> str:
    p = body.get("prompt", body.get("text", body.get("inputs")))
    if p is None and body.get("messages"):
        p = body["messages"][0].get("content")
    return p if isinstance(p, str) else ""


class ReplayServer:
    """routes: {(METHOD, path): Transcript | {"stream": T, "nonstream": T}}."""

    def __init__(
        self,
        routes: dict,
        seed: int = 0,
        max_piece: int = 97,
        stall_s: float | None = None,
        drop_kept_alive: bool = False,
        not_ready: int = 0,
        close_after_response: bool = False,
        slow_s: float = 0.002,
    ):
        self.routes, self.seed, self.max_piece, self.stall_s = routes, seed, max_piece, stall_s
        self.drop_kept_alive, self.not_ready = drop_kept_alive, not_ready
        self.close_after_response, self.slow_s = close_after_response, slow_s
        self._dropped_texts: set[str] = set()  # prompt texts the `drop` fault has dropped once
        self.requests: list[dict] = []  # every POST body and its Authorization header
        self.armed = True  # False: FAULT: prompts are served normally
        self.dropped = 0  # requests lost to drop_kept_alive
        self.answered_503 = 0
        self.connections: list[dict] = []  # per connection: {"requests": n, "close": the client's Connection header}
        self._served: dict = {}  # transport -> its entry in connections (strong refs: ids never reused)
        self._seen = threading.Condition()
        self._n = 0

    # -- lifecycle: a thread with its own loop -------------------------------
    def __enter__(self) -> "ReplayServer":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def wait_requests(self, n: int, timeout: float = 60.0) -> list[dict]:
        """Block until the server has received n POST requests (an event, not a guess at timing);
        AssertionError after `timeout` seconds (a hang, not slowness)."""
        with self._seen:
            if not self._seen.wait_for(lambda: len(self.requests) >= n, timeout):
                raise AssertionError(f"the server saw {len(self.requests)} requests, waited for {n}")
            return list(self.requests)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self._loop.run_forever()

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._release.set)  # end stalls, so cleanup does not wait on them
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- handling ---------------------------------------------------------------
    def _pick(self, request: web.Request, body: dict) -> Transcript | None:
        t = self.routes.get((request.method, request.path))
        if isinstance(t, dict):
            t = t["stream" if body.get("stream") else "nonstream"]
        return t

    def _connection(self, request: web.Request) -> bool:
        """Track the request's connection; True when drop_kept_alive closes it now (it served before)."""
        tr = request.transport
        conn = self._served.get(tr)
        if conn is None:
            conn = self._served[tr] = {"requests": 0, "close": []}
            self.connections.append(conn)
        conn["requests"] += 1
        conn["close"].append(request.headers.get("Connection", ""))
        if self.drop_kept_alive and conn["requests"] > 1:
            self.dropped += 1
            tr.close()  # FIN before any response byte: the client wrote to a connection being closed
            return True
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self._connection(request):
            return web.Response(status=204)  # never reaches the client: its connection is closed
        if self.answered_503 < self.not_ready:
            self.answered_503 += 1
            return web.json_response(
                {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}, status=503
            )
        raw = await request.read()
        body = {}
        if request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                return web.json_response({"error": {"message": "bad json", "code": 500}}, status=500)
            with self._seen:
                self.requests.append({"path": request.path, "body": body, "auth": request.headers.get("Authorization")})
                self._seen.notify_all()
        t = self._pick(request, body)
        if t is None:
            return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)
        text = _prompt_text(body)
        fault = text.split(":", 1)[1].split()[0] if text.startswith("FAULT:") and self.armed else ""
        if fault == "500":
            return web.json_response(
                {"error": {"message": "injected failure", "type": "server_error", "code": 500}}, status=500
            )
        if fault == "400":
            return web.json_response(
                {"error": {"message": "injected bad request", "type": "BadRequestError", "code": 400}}, status=400
            )
        if fault == "dropall" or (fault == "drop" and text not in self._dropped_texts):
            self._dropped_texts.add(text)
            self.dropped += 1
            request.transport.close()  # FIN before any response byte (the body was read: no RST)
            return web.Response(status=204)  # never reaches the client
        self._n += 1
        rng = random.Random(self.seed * 1000 + self._n)
        # The recorded headers, minus framing (aiohttp frames the re-chunked body itself).
        heads = {
            k: v for k, v in t.headers.items() if k not in ("content-length", "transfer-encoding", "connection", "date")
        }
        resp = web.StreamResponse(status=t.status, headers=heads)
        await resp.prepare(request)
        payload = self._faulted(t, fault)
        if fault in ("cut", "reset", "stall"):
            payload = payload[: len(payload) // 2]
        for piece in _split(payload, rng, self.max_piece):
            try:
                await resp.write(piece)
            except ConnectionError:  # the client gave up mid-body (it read a bad event): nothing to log
                return resp
            await asyncio.sleep(self.slow_s if fault == "slow" else 0)
        if fault == "stall":
            if self.stall_s is None:
                await self._release.wait()  # until the server stops
            else:
                await asyncio.sleep(self.stall_s)
        if fault == "cut":
            request.transport.close()  # FIN without the last chunk
            return resp
        if fault == "reset":
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()  # RST
            return resp
        try:
            await resp.write_eof()
        except ConnectionError:
            pass  # the client gave up (a stall past its timeout)
        if self.close_after_response or fault == "closeafter":
            request.transport.close()  # FIN after the last chunk, the headers having promised keep-alive
        return resp

    def _faulted(self, t: Transcript, fault: str) -> bytes:
        ev = t.events()
        if fault == "cleancut":
            whole = b"".join(ev[:2])
            return whole + ev[2][: len(ev[2]) // 2]
        if fault == "nodone":
            return b"".join(e for e in ev if b"[DONE]" not in e and b'"stop":true' not in e and b'"details":{' not in e)
        if fault == "badjson":
            return b"".join(ev[:2]) + b'data: {"choices": [{"text": "x", \n\n' + b"".join(ev[3:])
        if fault == "badshape":  # valid JSON, but a logprobs entry without its logprob
            return (
                b"".join(ev[:2])
                + b'data: {"choices": [{"index": 0, "logprobs": {"content": [{"token": "x"}]}}]}\n\n'
                + b"".join(ev[2:])
            )
        if fault == "badfinish":  # what the trace's 16-byte ASCII column cannot hold
            return t.body.replace(b'"finish_reason":"length"', b'"finish_reason":"length_\\u00e9t\\u00e9_reached_here"')
        if fault == "surrogate":
            return b"".join(ev[:2]) + b'data: {"error": {"message": "bad \\ud800 byte"}}\n\n' + b"data: [DONE]\n\n"
        if fault == "longerror":  # an engine's long error text (a stack of words, 700+ characters)
            msg = " ".join(f"word{i:03d}" for i in range(90)).encode()
            return (
                b"".join(ev[:2])
                + b'data: {"error": {"message": "'
                + msg
                + b'", "code": 500}}\n\n'
                + b"data: [DONE]\n\n"
            )
        if fault == "errorevent":
            return (
                b"".join(ev[:2])
                + b'data: {"error": {"message": "injected engine error", "code": 500}}\n\n'
                + b"data: [DONE]\n\n"
            )
        return t.body


def _split(data: bytes, rng: random.Random, max_piece: int) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, max_piece)
        out.append(data[i : i + n])
        i += n
    return out


def routes_for(engine: str) -> dict:
    """The replay routes of one engine's transcripts."""
    L = load
    if engine == "llamacpp":
        return {
            ("GET", "/v1/models"): L("llamacpp-server__v1-models.http"),
            ("GET", "/health"): L("llamacpp-server__health.http"),
            ("GET", "/slots"): L("llamacpp-server__slots.http"),
            ("GET", "/props"): L("llamacpp-server__props.http"),
            ("POST", "/completion"): {
                "stream": L("llamacpp-server__completion__stream.http"),
                "nonstream": L("llamacpp-server__completion__nonstream.http"),
            },
            ("POST", "/v1/completions"): {
                "stream": L("llamacpp-server__v1-completions__stream.http"),
                "nonstream": L("llamacpp-server__v1-completions__nonstream.http"),
            },
            ("POST", "/v1/chat/completions"): {
                "stream": L("llamacpp-server__v1-chat-completions__stream.http"),
                "nonstream": L("llamacpp-server__v1-chat-completions__nonstream.http"),
            },
        }
    if engine == "llama-cpp-python":
        return {
            ("GET", "/v1/models"): L("llama-cpp-python__v1-models.http"),
            ("POST", "/v1/completions"): {
                "stream": L("llama-cpp-python__v1-completions__stream.http"),
                "nonstream": L("llama-cpp-python__v1-completions__nonstream.http"),
            },
        }
    if engine == "vllm":
        return {
            ("GET", "/v1/models"): L("vllm__v1-models.http"),
            ("POST", "/v1/completions"): {
                "stream": L("vllm__v1-completions__stream.http"),
                "nonstream": L("vllm__v1-completions__nonstream.http"),
            },
        }
    if engine == "sglang":
        return {
            ("GET", "/v1/models"): L("sglang__v1-models.http"),
            ("POST", "/generate"): {
                "stream": L("sglang__generate__stream.http"),
                "nonstream": L("sglang__generate__nonstream.http"),
            },
            ("POST", "/tokenize"): L("sglang__tokenize.http"),
        }
    if engine == "tgi":
        return {
            ("GET", "/v1/models"): L("tgi__v1-models.http"),
            ("GET", "/info"): L("tgi__info.http"),
            ("POST", "/generate"): L("tgi__generate__nonstream.http"),
            ("POST", "/generate_stream"): L("tgi__generate_stream__stream.http"),
            ("POST", "/tokenize"): L("tgi__tokenize.http"),
        }
    raise KeyError(engine)
