"""The variant tags of explain: one type, written by capture and read by analyze (a tag parsed
back wrongly would score a warm run as cold, and name the wrong cause)."""

import pytest

from tracekit.errors import TraceFormatError
from tracekit.variants import BURST, COLD, Variant


@pytest.mark.parametrize("text", ["alone:cold", "alone", "warm:48", "warm:0", "burst"])
def test_round_trip(text):
    v = Variant.parse(text)
    assert str(v) == text and Variant.from_params(v.to_params()) == v


def test_meaning():
    assert Variant.alone_at(0) == COLD and Variant.alone_at(112) == Variant("warm", 112)
    assert Variant.alone_at(-1) is None
    assert COLD.boundary_wanted == 0 and Variant("warm", 48).boundary_wanted == 48 and BURST.boundary_wanted is None
    assert COLD.alone and not BURST.alone


@pytest.mark.parametrize("text", ["warm", "warm:x", "cold", "alone:warm"])
def test_unknown_tags_are_refused(text):
    with pytest.raises(TraceFormatError):
        Variant.parse(text)
