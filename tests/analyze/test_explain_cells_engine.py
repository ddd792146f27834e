"""The report's engine-replay column (analyze/explain_cells.py): which side's token the engine's
own replay gives at t, cold and at A's and B's boundaries, from an explain.json pair."""

from __future__ import annotations

from tracekit.analyze.explain_cells import engine_replay_cell


def test_engine_replay_cell_names_the_side_per_history():
    p = {"token_a": 7, "token_b": 9, "boundary_a": 0, "boundary_b": 32,
         "teacher": {"engine:cold bf16": 7, "engine:warm:32 bf16": 9, "full fp32": 7}}  # fmt: skip
    assert engine_replay_cell(p) == "A / A / B"  # A's boundary 0 is the cold run
    p = {**p, "boundary_a": 16, "teacher": {"engine:cold bf16": 5, "engine:warm:32 bf16": 7}}
    assert engine_replay_cell(p) == "5 / - / A"  # a third token; A's boundary not run (or not proven)
