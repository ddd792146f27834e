"""Text for one-line messages: an engine's error text shortened at a word, never inside one."""

from __future__ import annotations

import re

_TAIL = re.compile(r"… \((\d+) chars\)$")


def clip(text: str, limit: int) -> str:
    """`text` on one line when it fits in `limit` characters; else the words that fit, then
    "… (N chars)", at most `limit` characters in all, so a reader sees it was shortened (an engine
    error cut mid-word reads as another error). A single word longer than the room is cut.
    Clipping a clipped text again keeps the original length N."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    m = _TAIL.search(text)
    body, total = (text[: m.start()], int(m.group(1))) if m else (text, len(text))
    tail = f"… ({total} chars)"
    room = max(1, limit - len(tail))
    cut = body[:room]
    if len(body) > room and body[room] != " ":  # inside a word: end at the last whole one, if it leaves half the room
        space = cut.rfind(" ")
        if space >= room // 2:
            cut = cut[:space]
    return cut.rstrip(" ,;:") + tail
