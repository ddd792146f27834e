"""capture_bench's ratios: each taken between the clients of one turn, the median of the turns
reported with their range (the host's speed drifts within a run; a ratio of medians taken at
different times would mix that drift in)."""

from __future__ import annotations

from bench import capture_bench


def _row(regime: str, client: str, c: int, rep: int, cpu: float) -> dict:
    return {"regime": regime, "client": client, "concurrency": c, "rep": rep, "cpu_s_per_1k_tokens": cpu}


def test_median_of_the_turns_ratios_and_their_range():
    rows = []
    # three turns at c=64: the host runs slower in the second, both clients alike
    for rep, (bare, tk, keep) in enumerate(((10.0, 13.0, 11.0), (20.0, 24.0, 23.0), (10.0, 15.0, 10.5))):
        rows += [_row("per-event", "bare", 64, rep, bare), _row("per-event", "tracekit", 64, rep, tk)]
        rows += [_row("per-event", "bare+keep", 64, rep, keep)]
    rows += [_row("per-event", "bare", 1, 0, 4.0), _row("per-event", "tracekit", 1, 0, 6.0)]
    got = capture_bench.ratios(rows, {1: 1, 64: 3})
    assert got["cpu_per_token_vs_bare_c64"] == 1.3  # turns 1.3, 1.2, 1.5: the median
    assert got["cpu_per_token_vs_bare_c64_range"] == [1.2, 1.5]
    # a ratio of medians would say 15 / 10 = 1.5: the slow turn's tracekit against a fast bare
    assert got["keep_floor_vs_bare_c64"] == 1.1
    assert got["cpu_per_token_vs_bare_c1"] == 1.5
    assert "cpu_per_token_vs_bare_c1_range" not in got  # one turn: no range
    assert "stepped_cpu_per_token_vs_bare_c64" not in got  # no stepped rows: no figure, never a made-up one


def test_even_number_of_turns_takes_the_middle_pair():
    rows = []
    for rep, tk in enumerate((12.0, 14.0)):
        rows += [_row("stepped", "bare", 64, rep, 10.0), _row("stepped", "tracekit", 64, rep, tk)]
    got = capture_bench.ratios(rows, {64: 2})
    assert got["stepped_cpu_per_token_vs_bare_c64"] == 1.3
    assert got["stepped_cpu_per_token_vs_bare_c64_range"] == [1.2, 1.4]
