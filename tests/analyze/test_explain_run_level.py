"""explain's run-level and report-level rules, and its calibrated yardstick's edges, on built
traces (real HDF5, no engine): a failed run-level test or a misreport outranks every benign
cause; the FP32 configuration, an earlier near-tie and a burst within the healthy error against
the reference do not make a healthy pair a bug."""

from __future__ import annotations

import pytest
from support.explain_builders import NEAR_A, NEAR_B, PAIR, ab_traces, runs, write
from support.explain_builders import as_a as _as_a
from support.explain_builders import flip_calibration as _flip_calibration
from support.explain_builders import fp32_full as _fp32_full

from tracekit.analyze.explain import explain


@pytest.fixture
def ab(tmp_path):
    return ab_traces(tmp_path)


def test_a_failed_run_level_test_turns_every_benign_cause_into_a_bug(tmp_path, ab):
    """One pair at a time a batched-path bug is batch composition (a burst reproduces it, alone
    does not); across the run its flips are beyond this engine's noise. Given that finding, the
    pair is a LOUD bug that keeps its own evidence; without it, the same runs stay benign."""
    from tracekit.analyze.explain import RUN_LEVEL

    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, near=NEAR_B)
    v = write(tmp_path / "v.h5", rows)
    finding = "16 flips where this engine's calibration predicts 7.03 (95% interval 2-13, p = 0.00325)"
    benign = explain(*ab, [PAIR], [v], None, {"p": 3}).pairs[0]
    r = explain(*ab, [PAIR], [v], None, {"p": 3}, run_finding=finding)
    p = r.pairs[0]
    assert benign.kind == "batch_composition" and benign.ok
    assert p.kind == "bug" and p.loud and not p.ok and not r.ok
    assert p.cause.startswith(f"LOUD: classified bf16_tie_flip (benign), but {RUN_LEVEL} — {finding}")
    assert p.cause.endswith(f"this pair alone: {benign.cause}")
    assert f"run-level: {finding}" in r.notes


def test_run_finding_reads_the_flip_test_and_the_reference_test():
    """explain's run-level finding is diff's: None on a run its calibration predicts, the counts
    with the interval when the flips are beyond it (the committed demo's code16 c8 cell against a
    calibration whose healthy noise almost never flips, as test_calibration does)."""
    from support.demo_calibration import demo_pair as _pair
    from support.demo_calibration import strict as _strict

    from tracekit.analyze import diff
    from tracekit.analyze.calibrate import measure
    from tracekit.analyze.explain_noise import run_finding

    cal = measure([_pair("bf16", p, 4) for p in ("code16", "prefix8", "study128")], "demo-bf16-c4", eos=(0,))
    ok = diff(*_pair("bf16", "code16", 8), eos=(0,), calibration=cal)
    bad = diff(*_pair("bf16", "code16", 8), eos=(0,), calibration=_strict(cal, 1e-4))
    assert ok.flip_test.ok and run_finding(ok) is None
    t = bad.flip_test
    assert not t.ok and run_finding(bad) == (
        f"{t.observed} flips where this engine's calibration predicts {t.expected:.2f} (95% interval "
        f"{t.interval[0]:g}-{t.interval[1]:g}, p = {t.p_value:.3g}; {len(t.beyond)} above its largest healthy flip gap)"
    )


def test_a_misreported_pair_is_a_bug_whatever_explains_its_flip(tmp_path, ab):
    """A healthy tie flip of a burst, on an engine whose top-k rows are out of order: the flip is
    batch composition, the report is a bug, and explain says both."""
    from tracekit.analyze.explain import MISREPORTED

    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, near=NEAR_B)
    why = "B: top-k row out of order at 1 position (first 2)"
    r = explain(*ab, [PAIR | {"misreported": why}], [write(tmp_path / "v.h5", rows)], None, {"p": 3})
    p = r.pairs[0]
    assert p.kind == "bug" and p.loud and not r.ok
    assert f"{MISREPORTED} — {why}; the flip itself: cause: batch composition" in p.cause


def test_a_burst_that_tips_an_earlier_near_tie_is_still_calibrated_noise(tmp_path, ab):
    """A healthy BF16 burst can tip another near-tie before t (its batch mates differ from B's):
    that run left A's tokens at a tie, not by a jump, so the pair stays within the calibrated noise
    (the demo's p14 on a loaded machine). A run that leaves A's tokens by a 3-nat jump still
    refuses the excuse."""
    pair = {**PAIR, "gap_a": 0.02, "gap_a_ulp": None, "dtype_a": "bf16"}
    base = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    tie_at_1 = {1: (4, 6, -0.70, -0.71), **NEAR_A}  # the run chose 4 at position 1, a 0.01-nat tie with A's 6
    jump_at_1 = {1: (4, 6, -0.05, -3.05), **NEAR_A}
    cal = _flip_calibration(0.025)
    got = {}
    for name, near in (("tie", tie_at_1), ("jump", jump_at_1)):
        rows = base + runs("p", "burst", token_seqs=[[5, 4, 7], [5, 6, 7], [5, 6, 7]], near=near)
        r = explain(*ab, [pair], [write(tmp_path / f"{name}.h5", rows)], None, {"p": 3}, calibration=cal)
        got[name] = r.pairs[0]
    burst = next(c for c in got["tie"].variants if c.variant == "burst")
    assert burst.early == 1 and burst.early_numeric == 1 and burst.first_early == 1
    assert got["tie"].kind == "calibrated_noise" and got["tie"].ok
    assert got["jump"].kind == "bug" and got["jump"].loud
    assert next(c for c in got["jump"].variants if c.variant == "burst").early_numeric == 0


def test_the_fp32_configuration_leaving_a_early_does_not_refuse_the_calibrated_noise(tmp_path, ab):
    """The FP32 configuration computes in another dtype: it leaves BF16 A's tokens at position 0
    by design. Only the engine under test's own runs can show a different computation (the
    demo's s128-g1-p5 on a loaded machine: a 1-step tie within the calibration's largest healthy
    flip, LOUD bug because the FP32 runs left early)."""
    pair = {**PAIR, "gap_a": 0.02, "gap_a_ulp": None, "dtype_a": "bf16"}
    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", **_as_a(3))
    v = write(tmp_path / "v.h5", rows)
    fp32 = write(tmp_path / "fp32.h5", runs("p", "alone:cold", config="fp32", token_seqs=[[8, 6, 7]] * 2))
    r = explain(*ab, [pair], [v, fp32], None, {"p": 3}, calibration=_flip_calibration(0.025)).pairs[0]
    assert next(c for c in r.variants if c.config == "fp32").early == 2
    assert r.kind == "calibrated_noise" and r.ok
    own = runs("p", "burst", token_seqs=[[8, 6, 7]] * 3, near={0: (8, 5, -0.05, -3.05)})  # the engine's own jump
    v2 = write(tmp_path / "v2.h5", runs("p", "alone:cold", **_as_a(3)) + own)
    assert explain(*ab, [pair], [v2, fp32], None, {"p": 3}, calibration=_flip_calibration(0.025)).pairs[0].kind == "bug"


def test_a_burst_farther_than_alone_but_within_the_healthy_error_is_batch_composition(tmp_path, ab):
    """The H200 Qwen3-4B pair (random weights): bursts 0.501 nats from the FP32 reference, alone
    0.040 (ratio 12.5) — a bug by the ratio alone; but this engine's healthy sides reach 0.501 nats
    against the same reference (calibrate --reference), so the bursts are within its noise: batch
    composition, with both numbers. A calibration whose healthy sides stay below keeps it a bug."""
    import dataclasses

    rows = runs("p", "alone:cold", **_as_a(3)) + runs("p", "warm:32", cached=32, **_as_a(3))
    rows += runs("p", "burst", token_seqs=[[5, 6, 9]] * 3, lps=[-0.4, -0.4, -0.01], near=NEAR_B)
    v, ref = write(tmp_path / "v.h5", rows), _fp32_full(tmp_path)
    burst_err = explain(*ab, [PAIR], [v], ref, {"p": 3}).pairs[0]
    err = next(c for c in burst_err.variants if c.variant == "burst").err
    assert burst_err.kind == "bug" and err > 0.25

    def cal(healthy):
        return dataclasses.replace(  # drift up to 0.3 nats: the runs stay numeric under the 0.6-nat bound
            _flip_calibration(0.025),
            drift_max_nats={"p100": 0.3},
            ref_error={"reference": "fp32 full", "n": 80, "mean_nats": {"p100": healthy}},
        )

    assert cal(err * 1.01).ref_error_max == pytest.approx(err * 1.01)
    ok = explain(*ab, [PAIR], [v], ref, {"p": 3}, calibration=cal(err * 1.01)).pairs[0]
    assert ok.kind == "batch_composition" and ok.ok
    assert f"within this engine's healthy error against it (up to {err * 1.01:.3g} nats, calibrated)" in ok.cause
    assert explain(*ab, [PAIR], [v], ref, {"p": 3}, calibration=cal(err / 2)).pairs[0].kind == "bug"
