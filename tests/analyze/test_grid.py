"""The yardstick of every gap: steps of the run's own grid (analyze/grid.py), and
where a trace's dtype comes from. A wrong yardstick calls FP32 bugs BF16 ties
(issue 12), or a near-zero logit 256 ULP away from its neighbour."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.analyze.grid import on_grid, ordinal, resolve_dtype, spacing, steps
from tracekit.errors import ConfigError

BF16, FP16, FP32 = 7, 10, 23


def test_steps_are_exact_across_a_power_of_two():
    """15.5 .. 16 lies in [8, 16) where BF16 is spaced 1/16: 8 steps, not 4."""
    assert steps(16.0, 15.5, BF16, 16.0) == 8.0
    assert steps(16.25, 15.5, BF16, 16.25) == 10.0  # 2 steps of 1/8 above 16, 8 below
    assert steps(-16.0, -15.5, BF16, 16.0) == -8.0


def test_the_seed_flip_in_steps():
    assert steps(18.375, 18.375, BF16, 18.375) == 0.0
    assert steps(18.5, 18.25, BF16, 18.5) == 2.0


def test_fp32_is_judged_on_its_own_grid():
    """18.3 vs 18.0: 2.4 steps of BF16 spacing, 157,286 steps of FP32's."""
    assert steps(18.3, 18.0, BF16, 18.3) == pytest.approx(2.4)
    assert steps(np.float32(18.3), 18.0, FP32, 18.3) == pytest.approx(157286.4, abs=1)
    assert steps(4.0, 3.99609375, FP16, 4.0) == 2.0  # FP16 below 4 is spaced 2^-9


def test_floor_near_zero():
    """0 vs -0.0078 in a row whose top logits are ~16: measured at half the row's
    scale (spacing 1/16), 0.125 steps, not 256; a row whose top is ~0 at |x| = 1."""
    assert steps(0.0, -0.0078125, BF16, 16.0) == 0.125
    assert steps(0.0, -0.0078125, BF16, 0.0) == 1.0
    assert steps(0.0, -0.0078125, BF16, 0.0, floor_abs=0.5) == 2.0


def test_spacing_and_on_grid():
    assert spacing(np.array([1.0, 15.9, 16.0, 40.0]), BF16).tolist() == [2**-7, 2**-4, 2**-3, 2**-2]
    assert on_grid(np.array([18.375, 18.3, 0.0]), BF16).tolist() == [True, False, True]
    assert on_grid(np.array([np.nan]), BF16).tolist() == [False]


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(0x3F80, 0x42FF), st.integers(1, 40))
def test_neighbouring_bf16_numbers_are_one_step_apart(u, n):
    """Property: n representable BF16 numbers apart is n steps, at any magnitude in
    [1, 128) with the floor at 1 (the grid is exact above the floor)."""
    lo = np.array([u << 16], np.uint32).view(np.float32)[0]
    hi = np.array([(u + n) << 16], np.uint32).view(np.float32)[0]
    assert ordinal(hi, BF16, 1.0) - ordinal(lo, BF16, 1.0) == n


def test_non_finite_values_have_no_distance():
    assert np.isnan(steps(np.nan, 1.0, BF16, 1.0)) and np.isnan(steps(np.inf, 1.0, BF16, 1.0))


# -- where the dtype comes from ----------------------------------------------------


@pytest.mark.parametrize(
    "run,dtype,source",
    [
        ({"engine": {"v1_models": {"meta": {"logits_dtype": "bf16", "dtype": "bf16"}}}}, "bf16", "logits_dtype"),
        ({"engine": {"v1_models": {"meta": {"dtype": "bf16"}}}}, "bf16", "engine self-report (dtype)"),
        ({"engine": {"info": {"model_dtype": "torch.float16"}}}, "fp16", "TGI model_dtype"),
        ({"dtype": "fp32", "dtype_source": "--dtype"}, "fp32", "run metadata dtype (--dtype)"),
        ({"dtype": "bfloat16"}, "bf16", "capture label (run dtype)"),
        ({"dtype": None}, "bf16", "assumed"),
        ({}, "bf16", "assumed"),
    ],
)
def test_dtype_from_run_metadata(run, dtype, source):
    g, _ = resolve_dtype(run)
    assert g.dtype == dtype and source in g.source and g.known == (source != "assumed")


def test_dtype_conflict_is_judged_on_the_finest_and_override_wins():
    """Names that disagree: the finest grid judges (a false FP32 label can only cost a
    false alarm; a false BF16 one could hide a bug), with a note naming both."""
    g, note = resolve_dtype({"engine": {"v1_models": {"meta": {"dtype": "bf16"}}}, "dtype": "fp32"})
    assert g.dtype == "fp32" and "names several dtypes" in note and "says bf16" in note
    g, note = resolve_dtype({"dtype": "bf16"}, override="fp32")
    assert (g.dtype, g.source, note) == ("fp32", "--dtype", None)
    with pytest.raises(ConfigError, match="expected one of"):
        resolve_dtype({}, override="int8")
