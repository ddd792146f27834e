"""History specs: parsing and the segment ends each history runs."""

from __future__ import annotations

import pytest

from tracekit.capture.teacher.history import HistorySpec, parse_dtypes, parse_histories
from tracekit.errors import ConfigError


def test_parse_all_kinds_in_order_without_repeats():
    specs = parse_histories("full, prefix:64,prefix:auto,chunked:32,decode,full")
    assert [s.label for s in specs] == ["full", "prefix:64", "prefix:auto", "chunked:32", "decode"]


@pytest.mark.parametrize("bad", ["prefix", "prefix:0", "prefix:-3", "chunked:x", "chunked", "decode:2", "ful", ""])
def test_bad_history_is_a_config_error_listing_choices(bad):
    with pytest.raises(ConfigError, match="full, prefix:B, prefix:auto, chunked:C, decode"):
        parse_histories(bad)


def test_dtypes():
    assert parse_dtypes("fp32,BF16,fp32") == ("fp32", "bf16")
    with pytest.raises(ConfigError, match="fp32, bf16, fp16"):
        parse_dtypes("fp8")


def test_segment_ends():
    """P=10 prompt + G=5 generated tokens: 14 inputs; every history ends at 14."""
    p, g = 10, 5
    assert HistorySpec("full").resolve(p, g).ends == (14,)
    h = HistorySpec("prefix", 4).resolve(p, g)
    assert (h.label, h.ends, h.cached_tokens) == ("prefix:4", (4, 14), 4)
    assert HistorySpec("chunked", 4).resolve(p, g).ends == (4, 8, 12, 14)
    assert HistorySpec("chunked", 100).resolve(p, g).ends == (14,)
    assert HistorySpec("decode").resolve(p, g).ends == (10, 11, 12, 13, 14)


def test_prefix_auto_takes_the_trace_boundary_and_skips_unknown():
    auto = HistorySpec("prefix", None)
    h = auto.resolve(10, 5, cached_tokens=8)
    assert (h.label, h.ends, h.cached_tokens) == ("prefix:8", (8, 14), 8)
    assert auto.resolve(10, 5, cached_tokens=-1) is None  # not reported
    assert auto.resolve(10, 5, cached_tokens=0) is None  # no reuse: nothing to replay
    assert HistorySpec("prefix", 14).resolve(10, 5) is None  # boundary past the inputs


def test_a_history_that_does_not_apply_says_why():
    """A skipped prefix history names its reason: a user seeing only "did not apply" cannot tell
    an unreported boundary from one where nothing was reused (then `full` is that history)."""
    from tracekit.capture.teacher.history import HistorySpec

    auto = HistorySpec("prefix", None)
    assert auto.resolve(20, 4, -1) is None and "no cached-token count" in auto.why_not(20, 4, -1)
    assert auto.resolve(20, 4, 0) is None and "nothing reused" in auto.why_not(20, 4, 0)
    assert HistorySpec("prefix", 40).resolve(20, 4) is None
    assert HistorySpec("prefix", 40).why_not(20, 4) == "boundary 40 is not inside the 23 inputs"
