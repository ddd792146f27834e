"""The SSE decoder against the spec's edge cases and the recorded streams."""

from __future__ import annotations

import random

import pytest
from support.replay import load

from tracekit.capture.sse import SSEDecoder, SSEEvent


def feed_all(data: bytes, cuts: list[int]) -> tuple[list[SSEEvent], SSEDecoder]:
    dec, out, last = SSEDecoder(), [], 0
    for c in sorted(cuts) + [len(data)]:
        out += dec.feed(data[last:c])
        last = c
    return out, dec


def test_every_split_point_gives_the_same_events():
    """Events split across network chunks, including inside a UTF-8 character and a CRLF."""
    data = 'data: {"t": "é€😀"}\r\n\r\n: ping\r\ndata: a\r\ndata: b\r\n\r\nevent: error\ndata: x\n\n'.encode()
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


@pytest.mark.parametrize(
    "name",
    [
        "llamacpp-server__v1-chat-completions__stream.http",
        "llama-cpp-python__v1-completions__stream.http",
        "tgi__generate_stream__stream.http",
    ],
)
def test_recorded_streams_at_random_boundaries(name):
    body = load(name).body
    want, _ = feed_all(body, [])
    assert want[-1].data == "[DONE]" or "tgi" in name
    rng = random.Random(1)
    for _ in range(50):
        cuts = rng.sample(range(1, len(body)), 20)
        got, dec = feed_all(body, cuts)
        assert got == want and not dec.partial


def feed_data_all(data: bytes, cuts: list[int]) -> tuple[list, SSEDecoder]:
    dec, out, last = SSEDecoder(), [], 0
    for c in sorted(cuts) + [len(data)]:
        out += dec.feed_data(data[last:c])
        last = c
    return out, dec


def as_data(events: list[SSEEvent]) -> list:
    """What feed_data promises for what feed returns: bytes for default-type events."""
    return [ev.data.encode() if not ev.event else SSEEvent(ev.data, ev.event, ev.id) for ev in events]


FAST_PATH_STREAMS = [
    # The engine shape, then everything that leaves the fast path mid-stream and comes back.
    b'data: {"a": 1}\n\ndata:{"b": 2}\n\n: ping\n\ndata: [DONE]\n\n',
    'data: {"t": "é€😀"}\n\ndata: a\ndata: b\n\nevent: error\ndata: x\n\ndata: y\n\n'.encode(),
    b"data: 1\r\n\r\ndata: 2\n\n\n\ndata: 3\n\nid: 4\ndata: 5\n\ndata:\n\ndata: 6\n\n",
    "\ufeffdata: bom\n\ndata: 2\n\n: c\ndata: 3\n\ndata: 4\r\rdata: 5\n\n".encode(),
    # Each event's shape is checked at that event: a third blank line, an empty data line, a
    # two-line event, a field the spec ignores, then the engine shape again.
    b"data: 1\n\ndata: 2\n\n\ndata: 3\n\ndata: \n\ndata: 4\ndata: 5\n\ndata: 6\n\nretry: 5\n\ndata: 7\n\n",
]


@pytest.mark.parametrize("data", FAST_PATH_STREAMS)
def test_feed_data_matches_the_spec_path_at_every_split(data):
    """The bytes fast path gives the spec path's events at any chunking, including
    chunks that split a UTF-8 character, a CRLF, a BOM or the blank line."""
    spec, _ = feed_all(data, [])
    want = as_data(spec)
    assert feed_data_all(data, [])[0] == want
    for i in range(1, len(data)):
        got, dec = feed_data_all(data, [i])
        assert got == want, i
        assert not dec.partial
    rng = random.Random(0)
    for _ in range(30):
        got, dec = feed_data_all(data, rng.sample(range(1, len(data)), min(8, len(data) - 1)))
        assert got == want and not dec.partial


def test_feed_data_partial_and_recorded_streams():
    dec = SSEDecoder()
    assert dec.feed_data(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
    assert dec.partial
    dec2 = SSEDecoder()
    assert dec2.feed_data(b"data: x\n\n: ping\n") == [b"x"]
    assert not dec2.partial  # a trailing comment line is no unfinished event
    for name in ("llamacpp-server__v1-chat-completions__stream.http", "tgi__generate_stream__stream.http"):
        body = load(name).body
        want = as_data(feed_all(body, [])[0])
        rng = random.Random(2)
        for _ in range(20):
            got, dec = feed_data_all(body, rng.sample(range(1, len(body)), 20))
            assert got == want and not dec.partial
