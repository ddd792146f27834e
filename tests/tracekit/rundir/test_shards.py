"""Shard choice (tracekit/rundir/shards.py, workflows/shards.py): deterministic from the cells'
units, a serial-baseline group never split, a cell in the shard that measures the calibration
judging it (a fault target's cells with the healthy engine they borrow from), every cell in
exactly one shard, and stable when the matrix grows."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tracekit.capture.matrix import load_matrix
from tracekit.errors import ConfigError
from tracekit.rundir import Cell
from tracekit.rundir.shards import Shard, parse_shard, select, shard_of
from tracekit.workflows.shards import calibration_unit, shard_cells, shard_info

ROOT = Path(__file__).resolve().parents[3]
MATRICES = ["cpu_small", "demo", "study", "study_h200"]


def test_parse_shard():
    assert parse_shard("0/3") == Shard(0, 3) and parse_shard(" 2 / 3 ") == Shard(2, 3)
    assert parse_shard("0/1").label == "0/1"
    for bad in ("3/3", "1/0", "-1/3", "a/3", "1", "1/2/3", ""):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


def test_the_assignment_is_sha1_of_the_unit():
    """Any scheduler (or a shell script) can compute it: the first 8 bytes of sha1(unit), mod N."""
    unit = "ref.fp32.cache-on"
    h = int.from_bytes(hashlib.sha1(unit.encode()).digest()[:8], "big")
    assert h == 0xFA3254E65DA8E423
    assert [shard_of(unit, n) for n in (1, 2, 3, 8, 64)] == [h % n for n in (1, 2, 3, 8, 64)]


@pytest.mark.parametrize("matrix", MATRICES)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_every_cell_in_one_shard_and_groups_and_calibrations_never_split(matrix, n):
    m = load_matrix(ROOT / "fixtures/matrix" / f"{matrix}.toml")
    cells = m.cells()
    parts = [shard_cells(m, Shard(i, n)) for i in range(n)]
    assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in cells)  # each once
    for i, p in enumerate(parts):
        assert [c for c in cells if c in p] == p  # matrix order kept
        others = [c for j, q in enumerate(parts) if j != i for c in q]
        assert not {c.group_id for c in p} & {c.group_id for c in others}  # a group in one shard only
        assert not {calibration_unit(m, c) for c in p} & {calibration_unit(m, c) for c in others}
    info = [shard_info(m, Shard(i, n)) for i in range(n)]
    assert all(s.cell_shards == info[0].cell_shards for s in info)  # every shard says the same split
    assert {c: i for i, s in enumerate(info) for c in s.cells} == dict(info[0].cell_shards)


def test_a_fault_target_goes_with_the_calibration_it_borrows():
    m = load_matrix(ROOT / "fixtures/matrix/cpu_small.toml")
    fault = next(c for c in m.cells() if c.target == "ref-fault")
    assert not m.target("ref-fault").calibrate and calibration_unit(m, fault) == "ref.fp32.cache-on"
    for n in (2, 3, 8):
        (i,) = [i for i in range(n) if fault in shard_cells(m, Shard(i, n))]
        assert any(c.engine_id == "ref.fp32.cache-on" for c in shard_cells(m, Shard(i, n)))


def test_the_cpu_matrix_splits_into_non_empty_shards():
    """The fixtures the sharded tests run: 4 calibration units (the fault cell with ref.fp32.cache-on)
    -> 4+5 cells over 2 shards, 2+5+2 over 3."""
    m = load_matrix(ROOT / "fixtures/matrix/cpu_small.toml")
    for n, want in ((2, [4, 5]), (3, [2, 5, 2])):
        assert [len(shard_cells(m, Shard(i, n))) for i in range(n)] == want


def test_growing_the_matrix_moves_no_cell():
    """Adding a target, a dtype, a prompt set and a concurrency: every old cell keeps its shard."""
    old = [Cell("a", dt, pc, "p", 32, c) for dt in ("fp32", "bf16") for pc in (True, False) for c in (4, 8)]
    new = old + [Cell("b", "bf16", True, "p", 32, 4), Cell("a", "fp16", True, "p", 32, 4)]
    new += [Cell("a", "fp32", True, "q", 32, 4), Cell("a", "fp32", True, "p", 32, 16)]
    for n in (2, 3, 8, 64):
        before = {c.id: i for i in range(n) for c in select(old, Shard(i, n))}
        after = {c.id: i for i in range(n) for c in select(new, Shard(i, n))}
        assert {k: after[k] for k in before} == before
        # a new concurrency or prompt set joins its engine's shard (its calibration, its baselines)
        assert (
            after["a.fp32.cache-on.p.out32.c16"]
            == after["a.fp32.cache-on.q.out32.c4"]
            == after["a.fp32.cache-on.p.out32.c4"]
        )
