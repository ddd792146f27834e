"""The --teacher-forced cross-check and row selection in teacher-forced traces."""

from __future__ import annotations

import pytest
from support.analyze_builders import Req, flip, write_trace

from tracekit.analyze import diff
from tracekit.errors import AlignmentError, ConfigError

A = [5, 6, 7, 8]
B = [5, 6, 99, 8]


def _diag_rows(key, tokens, argmax_by_config):
    """Teacher-forced rows replaying `tokens`; at position 2 each config's top-1 is given."""
    out = []
    for (hist, dt), top in argmax_by_config.items():
        other = 99 if top == 7 else 7
        out.append(
            Req(
                key,
                tokens,
                history=hist,
                dtype=dt,
                cached=2 if hist.startswith("prefix") else 0,
                rows={2: flip(top, other, -0.7, -0.79375, 4.0, 3.90625)},  # 6 BF16 steps apart
            )
        )
    return out


@pytest.fixture
def traces(tmp_path):
    tie_a, tie_b = {2: flip(7, 99, -0.7, -0.75)}, {2: flip(99, 7, -0.7, -0.75)}
    a = write_trace(tmp_path / "a.h5", [Req(k, A, rows=tie_a) for k in ("rep", "norep", "nodiag", "other")])
    b = write_trace(tmp_path / "b.h5", [Req(k, B, rows=tie_b) for k in ("rep", "norep", "nodiag", "other")])
    rows = _diag_rows("rep", A, {("full", "fp32"): 7, ("full", "bf16"): 7, ("prefix:2", "bf16"): 99})
    rows += _diag_rows("norep", A, {("full", "fp32"): 7, ("full", "bf16"): 7, ("prefix:2", "bf16"): 7})
    rows += _diag_rows("other", [5, 1, 7, 8], {("full", "fp32"): 99})  # replays other tokens before t
    d = write_trace(tmp_path / "diag.h5", rows, raw=True, source="teacher_forced")
    return a, b, d


def test_teacher_forced_verdicts(traces):
    a, b, d = traces
    r = diff(a, b, teacher=d)
    got = {p.key: (p.cls, p.teacher) for p in r.pairs}
    assert got["rep"] == (
        "bf16_tie_flip",
        "reproduced by prefix:2 bf16 (1/3 pick B's token, 2/3 A's); FP32 full history picks A's token",
    )
    assert got["norep"] == ("bf16_tie_flip", "not reproduced (3 configurations)")
    assert got["nodiag"][1] == "no diagnostic row for this key"
    assert got["other"][1].startswith("not comparable")
    # The cross-check never changes a class.
    assert [p.cls for p in r.pairs] == [p.cls for p in diff(a, b).pairs]


def test_history_that_differs_from_full_counts_as_reproduced(tmp_path):
    """prefix:2 bf16 picks a third token: it flips relative to full bf16, even though not to B's token."""
    a = write_trace(tmp_path / "a.h5", [Req("k", A, rows={2: flip(7, 99, -0.7, -0.75)})])
    b = write_trace(tmp_path / "b.h5", [Req("k", B, rows={2: flip(99, 7, -0.7, -0.75)})])
    d = write_trace(
        tmp_path / "d.h5",
        _diag_rows("k", A, {("full", "bf16"): 7, ("prefix:2", "bf16"): 50}),
        raw=True,
        source="teacher_forced",
    )
    assert diff(a, b, teacher=d).by_key("k").teacher == "reproduced by prefix:2 bf16 (0/2 pick B's token, 1/2 A's)"


def test_fp32_full_history_names_the_side_that_rounded_away(tmp_path):
    """Every configuration, FP32 full history included, picks B's token: that is not "FP32
    reproduces the flip" but "the serial run A rounded away from the FP32 choice"; said so."""
    a = write_trace(tmp_path / "a.h5", [Req("k", A, rows={2: flip(7, 99, -0.7, -0.75)})])
    b = write_trace(tmp_path / "b.h5", [Req("k", B, rows={2: flip(99, 7, -0.7, -0.75)})])
    conf = {("full", "fp32"): 99, ("full", "bf16"): 99, ("decode", "fp32"): 99, ("decode", "bf16"): 7}
    d = write_trace(tmp_path / "d.h5", _diag_rows("k", A, conf), raw=True, source="teacher_forced")
    got = diff(a, b, teacher=d).by_key("k").teacher
    assert got.startswith("reproduced by ") and "(3/4 pick B's token, 1/4 A's)" in got
    assert got.endswith("; FP32 full history picks B's token: A is the side that rounded away from it")


def test_diff_against_teacher_forced_rows_needs_a_selection(traces):
    a, _, d = traces
    with pytest.raises(AlignmentError, match="history=full,dtype=fp32.*--b-select"):
        diff(a, d)
    r = diff(a, d, b_select="history=full,dtype=bf16")
    assert {p.key: p.cls for p in r.pairs} == {
        "rep": "identical",
        "norep": "identical",
        "nodiag": "incomparable",
        "other": "incomparable",
    }
    # Two histories of the same diagnostic file: compared by what each predicts (its top-1),
    # not by the replayed tokens, which are the same in every history. Logits 4.0 vs 3.90625
    # are 6 BF16 steps apart (below 4 the grid is spaced 1/64): beyond the tie tolerance (4),
    # within the drift tolerance (16), at different boundaries (0 vs 2).
    r = diff(d, d, a_select="history=full,dtype=bf16", b_select="history=prefix:2,dtype=bf16")
    rep = r.by_key("rep")
    assert (rep.cls, rep.position, rep.token_a, rep.token_b) == ("cache_boundary", 2, 7, 99)
    assert (rep.boundary_a, rep.boundary_b) == (0, 2) and (rep.dtype_a, rep.dtype_b) == ("bf16", "bf16")
    assert (rep.gap_a_ulp, rep.gap_b_ulp) == (6.0, 6.0)
    assert r.by_key("norep").cls == "identical"
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        diff(a, d, b_select="layer=3")
    with pytest.raises(AlignmentError, match="no request row matches"):
        diff(a, d, b_select="history=decode")


def test_show_compares_teacher_forced_histories_by_top1(traces):
    from tracekit.analyze.show import drill

    _, _, d = traces
    out = drill(d, d, "rep", a_select="history=full,dtype=bf16", b_select="history=prefix:2,dtype=bf16")
    assert out["first_difference"] == 2 and out["position"] == 2
    at = next(r for r in out["rows"] if r["position"] == 2)
    assert (at["a"]["id"], at["b"]["id"], at["same"]) == (7, 99, False)
    assert out["b"]["history"] == "prefix:2" and out["b"]["cached_tokens"] == 2
    assert out["a"]["topk_at_position"][1]["ulp_from_top1"] == 6.0
    assert out["a"]["grid"] == {"dtype": "bf16", "source": "the row's dtype"}
