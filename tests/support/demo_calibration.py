"""The committed demo's traces as calibration inputs, and a calibration stricter than the engine's
noise (tests of the run-level flip test: test_calibration.py, test_explain_verdict.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tracekit.calibration import NATS_EDGES, Calibration, GapBins

DEMO = Path(__file__).resolve().parents[2] / "traces" / "demo"


def demo_pair(dtype: str, prompts: str, c: int) -> tuple[str, str]:
    """(serial baseline, burst of c) of the committed demo's cell ref.<dtype>.cache-on.<prompts>.out32."""
    g = DEMO / "groups" / f"ref.{dtype}.cache-on.{prompts}.out32" / "serial.h5"
    b = DEMO / "cells" / f"ref.{dtype}.cache-on.{prompts}.out32.c{c}" / "burst.h5"
    return str(g), str(b)


def strict(cal: Calibration, p_small: float) -> Calibration:
    """The same gaps with 10,000 trials a bin and flips only at rate p_small in the
    smallest bin: an engine whose healthy noise almost never flips."""
    n = len(NATS_EDGES) - 1
    bins = GapBins("nats", NATS_EDGES, (10_000,) * n, (int(10_000 * p_small),) + (0,) * (n - 1))
    return dataclasses.replace(cal, name="strict", flip_nats=bins, flip_steps=None, flip_gap_max_nats=5e-5)
