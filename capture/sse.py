"""One spec-following Server-Sent Events decoder (WHATWG HTML §9.2.6).

Feed it raw network chunks as they arrive; it returns the events completed so
far. It handles what real engines send: several events in one chunk, one event
split over many chunks, a multi-byte UTF-8 character split between chunks
(incremental decoder), CRLF / CR / LF line ends (a CRLF may itself be split),
comment lines (`: ping`, which many servers send as keep-alives), multi-line
`data:` fields, and `data:` with or without the space after the colon (TGI
omits it). It does not parse JSON and knows nothing about engines: the
dialects do that.
"""

from __future__ import annotations

import codecs
from typing import NamedTuple


class SSEEvent(NamedTuple):
    """One dispatched event. `event` is "" for the default "message" type."""

    data: str
    event: str = ""
    id: str = ""


class SSEDecoder:
    """Incremental SSE decoder. `feed(bytes) -> [SSEEvent]`, then `close()`."""

    __slots__ = ("_utf8", "_buf", "_data", "_event", "_id", "_pending_cr", "_started")

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""            # text after the last complete line
        self._data: list[str] = []
        self._event = ""
        self._id = ""
        self._pending_cr = False  # chunk ended in "\r": a "\n" may follow in the next one
        self._started = False     # the BOM may only be stripped at the very start

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._utf8.decode(chunk)
        if not self._started and text:
            self._started = True
            if text[0] == "\ufeff":
                text = text[1:]
        if self._pending_cr:
            self._pending_cr = False
            if text[:1] == "\n":
                text = text[1:]  # the "\n" of a CRLF split across chunks
        if "\r" in text:
            if text[-1] == "\r":
                self._pending_cr = True
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        buf = self._buf + text if self._buf else text
        if "\n" not in buf:
            self._buf = buf
            return []
        lines = buf.split("\n")
        self._buf = lines.pop()  # the unterminated tail (may be "")
        out: list[SSEEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    out.append(SSEEvent("\n".join(self._data), self._event, self._id))
                self._data = []
                self._event = ""
                continue
            self._field(line)
        return out

    def _field(self, line: str) -> None:
        # The hot case first: a `data:` line (one per token event).
        if line[:5] == "data:":
            self._data.append(line[6:] if line[5:6] == " " else line[5:])
            return
        if line[0] == ":":
            return  # a comment, often a keep-alive ping
        name, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if name == "data":       # "data" with no colon: an empty data line
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        # "retry" and unknown fields are ignored, as the spec says.

    @property
    def partial(self) -> bool:
        """True when bytes of an unfinished event are buffered (a stream cut mid-event)."""
        return bool(self._buf) or bool(self._data) or bool(self._event)

    def close(self) -> list[SSEEvent]:
        """End of stream. Per the spec an unterminated event is discarded; callers
        check `partial` first to tell a clean end from a cut."""
        self._utf8.decode(b"", final=True)
        return []
