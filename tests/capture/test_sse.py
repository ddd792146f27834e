"""The SSE decoder against the spec's edge cases and the recorded streams."""

from __future__ import annotations

import random

import pytest

from capture.sse import SSEDecoder, SSEEvent

from replay import load


def feed_all(data: bytes, cuts: list[int]) -> tuple[list[SSEEvent], SSEDecoder]:
    dec, out, last = SSEDecoder(), [], 0
    for c in sorted(cuts) + [len(data)]:
        out += dec.feed(data[last:c])
        last = c
    return out, dec


def test_every_split_point_gives_the_same_events():
    """Events split across network chunks, including inside a UTF-8 character and a CRLF."""
    data = "data: {\"t\": \"é€😀\"}\r\n\r\n: ping\r\ndata: a\r\ndata: b\r\n\r\nevent: error\ndata: x\n\n".encode()
    whole, _ = feed_all(data, [])
    assert whole == [SSEEvent('{"t": "é€😀"}'), SSEEvent("a\nb"), SSEEvent("x", "error")]
    for i in range(1, len(data)):
        got, dec = feed_all(data, [i])
        assert got == whole, i
        assert not dec.partial


def test_spec_details():
    """No space after the colon (TGI), comments, lone CR line ends, BOM, empty data, ids."""
    data = "\ufeffdata:x\r\rid: 7\ndata\n\n:only a comment\n\nretry: 10\nfoo: bar\ndata:  two spaces\n\n".encode()
    got, dec = feed_all(data, [])
    assert got == [SSEEvent("x"), SSEEvent("", "", "7"), SSEEvent(" two spaces", "", "7")]


def test_partial_event_is_reported():
    dec = SSEDecoder()
    assert dec.feed(b'data: {"a": 1}\n\ndata: {"b"') == [SSEEvent('{"a": 1}')]
    assert dec.partial
    dec2 = SSEDecoder()
    dec2.feed(b"data: x\n")  # a field line without the blank line that dispatches it
    assert dec2.partial


@pytest.mark.parametrize("name", ["llamacpp-server__v1-chat-completions__stream.http",
                                  "llama-cpp-python__v1-completions__stream.http",
                                  "tgi__generate_stream__stream.http"])
def test_recorded_streams_at_random_boundaries(name):
    body = load(name).body
    want, _ = feed_all(body, [])
    assert want[-1].data == "[DONE]" or "tgi" in name
    rng = random.Random(1)
    for _ in range(50):
        cuts = rng.sample(range(1, len(body)), 20)
        got, dec = feed_all(body, cuts)
        assert got == want and not dec.partial
