"""report/gaps.png draws each grid in its own panel with its own tie line (issue 24 item 14):
BF16 steps and FP32 steps differ 2^16-fold, so their ULPs never share an axis, and the FP32 tie
line (64 ulp) is never drawn under BF16 points judged at 4 ulp."""

from __future__ import annotations

from tracekit.analyze.plots import gap_panels, gap_scatter
from tracekit.rundir import Cell, CellRecord, DiffRef, DiffSummary, LoadedCell, PairEvidence

BF16_TH = {"dtype": "bf16", "tie_ulps": 4, "drift_ulps": 16, "tie_nats": 0.5, "drift_nats": 0.5}
FP32_TH = {"dtype": "fp32", "tie_ulps": 64, "drift_ulps": 256, "tie_nats": 2**-13, "drift_nats": 2**-13}


def _pair(key: str, cls: str, position: int, gap_ulp: float) -> PairEvidence:
    return PairEvidence(key, cls, position, 5, 6, 0.1, 0.1, gap_ulp, gap_ulp, 0, 0, 0.01, "rule", None)


def _cell(dtype: str, th: dict, pairs: list[PairEvidence]) -> tuple[LoadedCell, DiffSummary]:
    c = Cell("ref", dtype, True, "p", 32, 8)
    counts = {"pairs": len(pairs), "identical": 0, "bf16_tie_flip": 0, "post_eos": 0, "cache_boundary": 0}
    counts |= {"unexplained": 0, "incomparable": 0}
    for p in pairs:
        counts[p.cls] += 1
    d = DiffSummary("a.h5", "b.h5", counts, th, tuple(pairs))
    rec = CellRecord(c, "a.h5", "b.h5", (), DiffRef(f"cells/{c.id}/diff.json", None))
    return LoadedCell(rec, d, None), d


def test_one_panel_per_grid_each_with_its_own_tie_line(tmp_path):
    bf16 = _cell("bf16", BF16_TH, [_pair("a", "bf16_tie_flip", 3, 1), _pair("b", "bf16_tie_flip", 7, 3)])
    fp32 = _cell("fp32", FP32_TH, [_pair("c", "unexplained", 1, 2.0e6)])
    assert gap_panels([bf16, fp32]) == {
        "fp32": {"grid": "fp32", "unit": "ulp", "points": 1, "tie_ulps": [64.0]},
        "bf16": {"grid": "bf16", "unit": "ulp", "points": 2, "tie_ulps": [4.0]},
    }
    assert gap_scatter([bf16, fp32], tmp_path / "gaps.png") == 3
    assert (tmp_path / "gaps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grid_is_the_one_the_diff_judged_on(tmp_path):
    """A BF16 engine's cell judged on the FP32 grid (diff --dtype fp32) is drawn with the FP32
    cells, at the FP32 tolerance; the BF16 panel keeps only 4 ulp."""
    bf16 = _cell("bf16", BF16_TH, [_pair("a", "bf16_tie_flip", 3, 1)])
    as_fp32 = _cell("bf16", FP32_TH, [_pair("b", "unexplained", 2, 100)])
    assert gap_panels([as_fp32, bf16]) == {
        "fp32": {"grid": "fp32", "unit": "ulp", "points": 1, "tie_ulps": [64.0]},
        "bf16": {"grid": "bf16", "unit": "ulp", "points": 1, "tie_ulps": [4.0]},
    }


def test_a_bf16_only_run_has_one_panel_at_4_ulp(tmp_path):
    cells = [_cell("bf16", BF16_TH, [_pair("a", "bf16_tie_flip", 3, 0)])]
    assert gap_panels(cells) == {"bf16": {"grid": "bf16", "unit": "ulp", "points": 1, "tie_ulps": [4.0]}}
    assert gap_scatter(cells, tmp_path / "g.png") == 1
