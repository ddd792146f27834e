"""A logprob-only run in the report (issue 24, item 10): llama.cpp sends no raw logits, so every
gap is in nats. gaps.png draws them on a nats panel (it was empty: only ULP points were drawn)
and the pair table's ULP column says "nats only (no logits)" instead of "? / ?"."""

from __future__ import annotations

from types import SimpleNamespace

from tracekit.analyze.plots import gap_scatter
from tracekit.analyze.run_report import PAIR_HEAD, CellRow, pair_rows
from tracekit.rundir import Cell, DiffSummary, PairEvidence

COUNTS = {"pairs": 3, "identical": 1, "post_eos": 0, "bf16_tie_flip": 1, "cache_boundary": 1}
COUNTS |= {"unexplained": 0, "incomparable": 0}


def _pair(key, cls, pos, gap_a, gap_b, ba, bb, ulp=None) -> PairEvidence:
    return PairEvidence(key, cls, pos, 7, 9, gap_a, gap_b, ulp, ulp, ba, bb, 1e-3, "rule", None)


def _loaded():
    cell = Cell("llama", "bf16", True, "p", 32, 4)
    pairs = (
        _pair("c0", "identical", None, None, None, 39, 39),
        _pair("c1", "bf16_tie_flip", 12, 0.004, 0.002, 39, 39),
        _pair("c2", "cache_boundary", 20, 0.03, 0.01, 34, 123),
    )
    th = {"dtype": "bf16", "tie_ulps": 4, "tie_nats": 0.5, "drift_nats": 0.5}
    diff = DiffSummary("a.h5", "b.h5", COUNTS, th, pairs)
    return SimpleNamespace(cell=cell, diff=diff), diff


def test_gaps_png_draws_nats_gaps(tmp_path):
    loaded, diff = _loaded()
    out = tmp_path / "gaps.png"
    assert gap_scatter([(loaded, diff)], out) == 2  # both divergent pairs, on the nats panel
    assert out.stat().st_size > 0
    with_logits = _pair("c3", "bf16_tie_flip", 5, 0.1, 0.1, 0, 0, ulp=1.0)
    mixed = DiffSummary("a", "b", COUNTS, diff.thresholds, (*diff.pairs, with_logits))
    assert gap_scatter([(loaded, mixed)], tmp_path / "mixed.png") == 3  # one ULP panel point, two in nats


def test_ulp_column_says_nats_only():
    loaded, _ = _loaded()
    rows = pair_rows([CellRow(loaded)])
    col = PAIR_HEAD.index("gap A / B ulp")
    assert [r[col] for r in rows] == ["nats only (no logits)"] * 2
    assert [r[PAIR_HEAD.index("gap A / B nats")] for r in rows] == ["0.004 / 0.002", "0.03 / 0.01"]
    assert [r[PAIR_HEAD.index("reused prefix A / B")] for r in rows] == ["39 / 39", "34 / 123"]
