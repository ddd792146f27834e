"""The listening socket of `tracekit serve`: a header deadline per connection, and the
warning when the address is reachable from other machines.

aiohttp (3.9 and later) never times out a client that opens a connection and
sends its request headers a byte at a time (a "slow-header" or slowloris
client holds the connection, and its memory, for as long as it likes; newer
versions only close it after the 75 s keep-alive). Each connection here gets
`read_timeout_s` to deliver the end of its first request's headers, then it
is closed. Later requests on a kept-alive connection are bounded by aiohttp's
keep-alive timeout, and a slow body by the handler (`server.py`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket


class HeaderDeadline(asyncio.Protocol):
    """Wraps aiohttp's protocol: closes the connection unless a blank line (the end of the
    request headers) arrives within `timeout_s` of connecting. Everything else is forwarded."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, loop: asyncio.AbstractEventLoop):
        self.inner, self.timeout_s, self.loop = inner, timeout_s, loop
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last 3 bytes seen, so a blank line split across reads is found

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = self.loop.call_later(self.timeout_s, self._expire)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            seen = self.tail + data
            # CRLF CRLF ends the headers (a bare LF LF too, which some parsers accept); after
            # that the deadline is off: bodies have their own timeout, responses may stream for long.
            if b"\r\n\r\n" in seen or b"\n\n" in seen:
                self.timer.cancel()
                self.timer = None
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _expire(self) -> None:
        self.timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


async def listen(protocol_factory, host: str, port: int, read_timeout_s: float) -> asyncio.AbstractServer:
    """Bind host:port and serve aiohttp's protocol (`runner.server`) behind a header deadline."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: HeaderDeadline(protocol_factory(), read_timeout_s, loop), host, port, reuse_address=True
    )


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ('' and 0.0.0.0 are all interfaces)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def exposure_warning(host: str, api_key: bool) -> str | None:
    """The stderr warning for an address other machines can reach; None on loopback."""
    if is_loopback(host):
        return None
    auth = "requests need the API key" if api_key else "anyone who can reach it can use it (no --api-key-env)"
    return (
        f"tracekit serve: WARNING: listening on {host or 'all interfaces'}, reachable from other machines; "
        f"{auth}. Use --host 127.0.0.1 to keep it local."
    )
