"""Incremental detokenization with stop strings, for one response.

Byte-level BPE tokens can end inside a UTF-8 character: text is released only
when it decodes cleanly (no trailing U+FFFD). Decoding looks at a short window
of recent tokens (vLLM's prefix/read offsets), so a long generation costs O(1)
per token, not O(length). While streaming, a tail that
could be the start of a stop string is held back, so a stop string never
leaks to the client; it is released at the end if no stop string completes.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix_off = self.read_off = 0  # ids[prefix_off:read_off] is already in self.text
        self.text = ""  # clean decoded text so far (cut at a stop string once matched)
        self.sent = 0  # characters already handed out
        self.stop_hit: str | None = None

    def push(self, token_id: int) -> tuple[str, int]:
        """Add one token. Returns (text released now, text offset where this token starts)."""
        offset = len(self.text)
        self.ids.append(token_id)
        if self.stop_hit is None:
            done = self.tok.decode(self.ids[self.prefix_off : self.read_off], skip_special_tokens=True)
            window = self.tok.decode(self.ids[self.prefix_off :], skip_special_tokens=True)
            if len(window) > len(done) and not window.endswith("\ufffd"):
                self.text += window[len(done) :]
                self.prefix_off, self.read_off = self.read_off, len(self.ids)
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0:  # keep the earliest match over all stop strings
                self.text, self.stop_hit = self.text[:i], s
        limit = len(self.text) if self.stop_hit else len(self.text) - self._held()
        delta, self.sent = self.text[self.sent : limit], max(self.sent, limit)
        return delta, min(offset, len(self.text))

    def flush(self) -> str:
        """Release everything still held back (call at the end of the response)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta

    def _held(self) -> int:
        """Length of the longest text tail that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
