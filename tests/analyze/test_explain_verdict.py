"""The verdict of `tracekit explain` from variant rows with known contents: each rule
fires on the runs that show its cause, with its counts, and nothing benign is
excused without a numeric reproduction (built traces, real HDF5, no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.explain_builders import A_TOK, NEAR_A, NEAR_B, PAIR, ab_traces, columns, record, runs, write
from support.explain_builders import as_a as _as_a
from support.explain_builders import as_b as _as_b
from support.explain_builders import flip_calibration as _flip_calibration
from support.explain_builders import fp32_full as _fp32_full

from tracekit.analyze.explain import explain  # noqa: E402
from tracekit.analyze.explain_report import markdown, text  # noqa: E402


@pytest.fixture
def ab(tmp_path):
    return ab_traces(tmp_path)


def _explain(tmp_path, ab, rows, pair=PAIR, teacher=None, mates=3):
    v = write(tmp_path / "variants.h5", rows)
    return explain(*ab, [pair], [v], teacher, {pair["key"]: mates}).pairs[0]


def test_prefix_reuse(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_b(3))
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "prefix_reuse" and p.ok
    assert p.cause == "cause: prefix reuse — B's token in 3/3 alone at B's boundary 32, 0/3 at A's boundary 0 (cold)"


def test_batch_composition(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9], [5, 6, 7], [5, 6, 9]], near=NEAR_B)
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "batch_composition"
    assert p.cause == (
        "cause: batch composition — B's token in 2/3 bursts with its 3 batch mates from B, "
        "0/3 alone at the same boundary 32"
    )


def test_nondeterminism_comes_first(tmp_path, ab):
    """Alone and cold giving both tokens is the engine's own noise, even if a warm run also flips."""
    rows = runs("p", "alone:cold", token_seqs=[[5, 6, 7], [5, 6, 9], [5, 6, 7]], near=NEAR_A)
    rows += runs("p", "warm:32", cached=32, **_as_b(3))
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "nondeterminism"
    assert "B's token in 1/3 runs, A's in 2/3" in p.cause


def test_non_numeric_reproduction_is_a_bug_and_loud(tmp_path, ab):
    """B's token every warm run, but with 2.5 nats of drift before t: a different computation
    (a corrupted cache block), not a near-tie. A benign class must not excuse it."""
    rows = runs("p", "alone:cold", **_as_a(3))
    rows += runs("p", "warm:32", cached=32, token_seqs=[[5, 6, 9]] * 3, near=NEAR_B, lps=[-2.5, -0.01, -0.7])
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "bug" and p.loud and not p.ok
    assert p.cause.startswith(
        "LOUD: classified bf16_tie_flip (benign), but not reproduced by any numeric variant — report as a bug"
    )
    assert "B's token came back in 3/3 warm:32 runs, but not numerically (drift 2.49 nats before t" in p.cause


def test_a_gap_beyond_the_tolerance_is_not_numeric(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_a(3))
    rows += runs("p", "warm:32", cached=32, token_seqs=[[5, 6, 9]] * 3, near={2: (9, 7, -0.1, -1.4)})
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "bug" and "gap 1.3 nats at t" in p.cause


def test_early_runs_and_failures_are_counted_apart(tmp_path, ab):
    rows = runs("p", "alone:cold", token_seqs=[[5, 4, 9], [5, 6, 7]], near=NEAR_A)
    rows += runs("p", "warm:32", token_seqs=[[5, 6]], cached=32)  # too short to reach t
    p = _explain(tmp_path, ab, rows)
    cold = next(c for c in p.variants if c.variant == "alone:cold")
    warm = next(c for c in p.variants if c.variant == "warm:32")
    assert (cold.n, cold.a, cold.b, cold.early, cold.first_early) == (2, 1, 0, 1, 1)
    assert (warm.n, warm.failed) == (1, 1)
    assert p.kind == "bug" and "1/2 alone:cold runs left A's tokens before t (first at 1)" in p.cause


def _teacher(tmp_path, winners: dict[str, int]):
    rows = []
    for label, tok in winners.items():
        hist, dtype = label.split()
        other = 9 if tok == 7 else 7
        rows.append(
            (
                record("p", history=hist, dtype=dtype),
                columns([5, 6, tok], near={2: (tok, other, -0.7, -0.8)}, logits=True),
            )
        )
    return write(tmp_path / "teacher.h5", rows, source="teacher_forced", raw=True)


def test_cache_history_from_the_teacher_and_which_side_is_right(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_a(2)) + runs("p", "warm:32", cached=32, **_as_a(2))
    tf = _teacher(tmp_path, {"full bf16": 7, "prefix:32 bf16": 9, "decode bf16": 7, "full fp32": 9})
    p = _explain(tmp_path, ab, rows, teacher=tf)
    assert p.kind == "cache_history"
    assert p.cause.startswith("cause: cache history — teacher-forced prefix:32 bf16 picks B's token, full bf16 A's")
    assert p.right_side == "B" and p.right.startswith("B agrees with the FP32 full-history argmax")
    assert p.teacher == {"full bf16": 7, "prefix:32 bf16": 9, "decode bf16": 7, "full fp32": 9}


def test_unresolved_when_a_is_never_reproduced(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_b(2)) + runs("p", "warm:32", cached=32, **_as_b(2))
    p = _explain(tmp_path, ab, rows)
    assert p.kind == "unresolved" and "B's token in all 4 live runs, A's in none" in p.cause and not p.ok


def test_other_configurations_and_reports(tmp_path, ab):
    """The deterministic configuration that still flips is said loudly in the evidence; the
    FP32 configuration's cold runs decide the right side when no teacher ran."""
    rows = runs("p", "alone:cold", **_as_a(2)) + runs("p", "warm:32", cached=32, **_as_b(2))
    det = runs("p", "alone:cold", config="deterministic", **_as_a(2))
    det += runs("p", "burst", config="deterministic", **_as_b(1))
    files = [
        write(tmp_path / "engine.h5", rows),
        write(tmp_path / "det.h5", det),
        write(tmp_path / "fp32.h5", runs("p", "alone:cold", config="fp32", **_as_a(3))),
    ]
    res = explain(*ab, [PAIR], files, None, {"p": 3})
    p = res.pairs[0]
    assert p.kind == "prefix_reuse"
    assert any(
        e.startswith("deterministic configuration: A's token in 2/3 runs, B's in 1/3") and "STILL FLIPS" in e
        for e in p.evidence
    )
    assert p.right_side == "A" and "FP32 configuration's alone runs (3/3)" in p.right
    assert res.counts()["prefix_reuse"] == 1 and res.ok
    assert "| p | bf16_tie_flip | 2 | 7 / 9 | 0 / 32 | cause: prefix reuse" in markdown(res)
    assert "p  bf16_tie_flip  t=2" in text(res)
    doc = res.to_json()
    assert doc["schema"] == "tracekit.explain/1" and doc["pairs"][0]["kind"] == "prefix_reuse"


def test_reported_boundary_mismatch_is_said(tmp_path, ab):
    """A warm run that did not reuse the primed prefix is evidence against the variant: said."""
    rows = runs("p", "alone:cold", **_as_a(2)) + runs("p", "warm:32", cached=16, **_as_b(2))
    p = _explain(tmp_path, ab, rows)
    assert "warm:32 runs reported reused prefixes {16: 2}, not only 32" in p.evidence


def _cli(*args):
    import subprocess

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tracekit", "explain", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)


def test_cli_errors(tmp_path, ab):
    """Usage errors exit 2, an unreachable engine exits 3, each with one `Error:` line; a
    chosen key that does not diverge is skipped, said, and nothing is sent."""
    for args, rc in (
        ((ab[0], "--url", "http://x"), 2),  # one trace
        ((*ab, "--url", "http://x", "--json", "--markdown"), 2),
        ((*ab, "--url", "http://127.0.0.1:9", "--out", tmp_path / "o"), 3),  # nothing listens on port 9
    ):
        out = _cli(*args)
        assert out.returncode == rc, out.stderr
        assert out.stderr.startswith("Error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    same = write(tmp_path / "same.h5", [(record("p", cached=0), columns(A_TOK, near=NEAR_A))])
    out = _cli(ab[0], same, "--url", "http://127.0.0.1:9", "--keys", "p,q", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    # p's tokens are equal on both sides; its class follows diff's rules (these fixture rows carry
    # no finish reason, which diff no longer excuses), but there is no differing token to replay.
    assert doc["pairs"] == [] and doc["skipped"][1] == "q: not in A or B"
    assert doc["skipped"][0].startswith("p: ") and doc["skipped"][0].endswith(", no differing token to replay")


def test_burst_farther_from_the_reference_than_alone_is_a_bug(tmp_path, ab):
    """A deterministic batched-path bug reproduces in bursts and never alone, exactly like
    batch composition; what tells them apart is the distance to the FP32 truth: here the
    bursts' logprobs before t are 0.39 nats off it, the alone runs' not at all."""
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, lps=[-0.4, -0.4, -0.01], near=NEAR_B)
    p = _explain(tmp_path, ab, rows, teacher=_fp32_full(tmp_path))
    assert p.kind == "bug" and not p.ok and p.loud  # classed benign one pair at a time
    assert "batched-path error beyond this engine's noise — B's token in 3/3 bursts, 0/3 alone" in p.cause
    burst = next(c for c in p.variants if c.variant == "burst")
    warm = next(c for c in p.variants if c.variant == "warm:32")
    assert burst.err > 0.25 and warm.err < 0.05 and f"{burst.err:.3g}" in p.cause


def test_burst_as_close_to_the_reference_as_alone_is_batch_composition(tmp_path, ab):
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, near=NEAR_B)
    r = explain(*ab, [PAIR], [write(tmp_path / "v.h5", rows)], _fp32_full(tmp_path), {"p": 3})
    p = r.pairs[0]
    assert p.kind == "batch_composition" and "as close to the FP32 reference as alone" in p.cause
    assert any(n.startswith("each run scored against the FP32 full teacher-forced replay (1 pairs)") for n in r.notes)
    assert any("numeric bound 0.5 nats: the documented default, uncalibrated" in n for n in r.notes)


def test_the_numeric_bound_comes_from_the_calibration(tmp_path, ab):
    """A deeper model's healthy noise moves the gap by more than 0.5 nats: measured, the bound follows it."""
    from tracekit.analyze.explain import numeric_bound
    from tracekit.calibration import NATS_EDGES, Calibration, GapBins

    n = len(NATS_EDGES) - 1
    cal = Calibration(
        "deep", "bf16", {}, 12, GapBins("nats", NATS_EDGES, (10,) * n, (0,) * n), None,
        {"p100": 0.9}, {"p100": 0.1}, 1.5, None,
    )  # fmt: skip
    assert numeric_bound(cal) == 3.0
    rows = runs("p", "alone:cold", **_as_a(2)) + runs("p", "warm:32", cached=32, **_as_a(2))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 2, lps=[-1.2, -0.01, -0.01], near=NEAR_B)
    v = write(tmp_path / "v.h5", rows)
    plain = explain(*ab, [PAIR], [v], None, {"p": 3}).pairs[0]
    r = explain(*ab, [PAIR], [v], None, {"p": 3}, calibration=cal)
    assert plain.kind == "bug"  # 1.19 nats of drift: not numeric on the 0.5-nat default
    assert r.pairs[0].kind == "batch_composition" and r.drift_nats == 3.0
    assert any("numeric bound 3 nats, measured: calibration deep" in n for n in r.notes)


def test_a_near_tie_within_the_calibrated_noise_is_not_a_bug(tmp_path, ab):
    """Issue 24 item 13: a benign pair no sampled run tipped, at a gap this healthy engine's repeats
    flip at, is the engine's calibrated noise (ok), not "report as a bug"; uncalibrated it stays LOUD.
    Outside the calibrated flips (a larger gap, or a calibration without flips) nothing is excused."""
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", **_as_a(3))  # B's token in no run: not reproduced
    v = write(tmp_path / "v.h5", rows)
    pair = {**PAIR, "gap_a": 0.02, "gap_a_ulp": None, "dtype_a": "bf16"}
    plain = explain(*ab, [pair], [v], None, {"p": 3}).pairs[0]
    assert plain.kind == "bug" and plain.loud and not plain.ok
    r = explain(*ab, [pair], [v], None, {"p": 3}, calibration=_flip_calibration(0.025)).pairs[0]
    assert r.kind == "calibrated_noise" and r.ok and not r.loud
    assert r.cause.startswith(
        "cause: this engine's calibrated noise — A's top-2 gap at t 0.02 nats, within the healthy flips of "
        "calibration healthy-repeats (up to 0.025 nats, its largest healthy flip; 3 flips in 40 healthy pairs)"
    )
    assert "report as a bug" not in r.cause
    for cal in (_flip_calibration(0.005), _flip_calibration(0.025, flips=0), _flip_calibration(0.0)):
        assert explain(*ab, [pair], [v], None, {"p": 3}, calibration=cal).pairs[0].kind == "bug"
    # above the largest healthy flip but inside its bin (0.02 < 0.025 < 0.03): not excused either
    # (the bin's edge excused prefix-key-collision flips); an exact-tie largest flip bounds nothing
    wider = {**pair, "gap_a": 0.028}
    assert explain(*ab, [wider], [v], None, {"p": 3}, calibration=_flip_calibration(0.025)).pairs[0].kind == "bug"


def test_a_different_computation_is_never_calibrated_noise(tmp_path, ab):
    """B's token back with 2.5 nats of drift before t (a corrupted block): within the calibrated gap
    or not, still a bug."""
    rows = runs("p", "alone:cold", **_as_a(3))
    rows += runs("p", "warm:32", cached=32, token_seqs=[[5, 6, 9]] * 3, near=NEAR_B, lps=[-2.5, -0.01, -0.7])
    v = write(tmp_path / "v.h5", rows)
    pair = {**PAIR, "gap_a": 0.02, "gap_a_ulp": None, "dtype_a": "bf16"}
    r = explain(*ab, [pair], [v], None, {"p": 3}, calibration=_flip_calibration(0.025)).pairs[0]
    assert r.kind == "bug" and r.loud


def _moving_calibration(move_nats: float):
    """A healthy engine whose drift and flips are small (numeric bound 0.2 nats) but whose top-2
    gap moves by up to `move_nats` between two healthy runs (calibrate's gap_move p100)."""
    import dataclasses

    cal = _flip_calibration(0.1)
    return dataclasses.replace(
        cal, gap_move={"n": 600, "nats": {"p50": 0.2, "p99": move_nats * 0.8, "p100": move_nats}, "steps": None}
    )


def test_a_burst_gap_within_the_healthy_gap_move_is_batch_composition(tmp_path, ab):
    """The H200 Qwen3-4B-shaped pair: bursts give B's token with B 1.5 nats above A's (a healthy
    padded batch moves the top-2 gap that far), drift before t tiny. The 0.5-nat default and a
    calibration that knows only flip gaps call it a bug; one that measured the gap move (2 nats)
    names batch composition, and says the bound; a smaller measured move (1 nat) keeps it a bug."""
    from tracekit.analyze.explain import numeric_bound

    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, near={2: (9, 7, -0.2, -1.7)})
    v = write(tmp_path / "v.h5", rows)
    assert numeric_bound(_flip_calibration(0.1)) == pytest.approx(0.2)
    assert explain(*ab, [PAIR], [v], None, {"p": 3}).pairs[0].kind == "bug"
    assert explain(*ab, [PAIR], [v], None, {"p": 3}, calibration=_flip_calibration(0.1)).pairs[0].kind == "bug"
    r = explain(*ab, [PAIR], [v], None, {"p": 3}, calibration=_moving_calibration(2.0))
    assert r.pairs[0].kind == "batch_composition" and "B's token in 3/3 bursts" in r.pairs[0].cause
    assert any(n.startswith("gap bound 2 nats at t: this engine's healthy top-2 gap move") for n in r.notes)
    assert explain(*ab, [PAIR], [v], None, {"p": 3}, calibration=_moving_calibration(1.0)).pairs[0].kind == "bug"


def test_a_flip_within_the_healthy_gap_move_is_calibrated_noise(tmp_path, ab):
    """No sampled run tipped the pair; A's gap 0.25 + B's 1.5 nats lies beyond every healthy flip
    (0.1) but within the healthy gap move (2 nats): this engine's calibrated noise, with the sum
    and the bound in the cause. Within a 1-nat move: not excused."""
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", **_as_a(3))
    v = write(tmp_path / "v.h5", rows)
    pair = {**PAIR, "gap_a": 0.25, "gap_b": 1.5, "gap_a_ulp": None, "dtype_a": "bf16"}
    r = explain(*ab, [pair], [v], None, {"p": 3}, calibration=_moving_calibration(2.0)).pairs[0]
    assert r.kind == "calibrated_noise" and r.ok and not r.loud
    assert "A's + B's top-2 gap at t 0.25 + 1.5 = 1.75 nats, within the healthy top-2 gap move" in r.cause
    assert "up to 2 nats, p100 over 600 positions" in r.cause
    assert explain(*ab, [pair], [v], None, {"p": 3}, calibration=_moving_calibration(1.0)).pairs[0].kind == "bug"
