"""Which cells a shard runs (`tracekit run --shard I/N`), and its record (shard.json).

A cell's unit is what its judgement needs (workflows/judge.py): the engine configuration whose
calibration it is judged with. For a target that calibrates that is its own engine
configuration (all of its groups: serial baselines, calibration repeats, cold references); a
target that may not calibrate itself (a fault target) borrows the first healthy target's of the
same dtype and cache setting, so its cells go with that engine. Units are hashed to shards by
`tracekit.rundir.shards` (sha1 mod N); merging shard directories is `tracekit.rundir.merge`.
"""

from __future__ import annotations

import dataclasses
import hashlib

from tracekit import __version__
from tracekit.capture.matrix.spec import Matrix
from tracekit.files import sha256_file
from tracekit.rundir import Cell
from tracekit.rundir.shards import Shard, ShardInfo, select, shard_of


def calibration_unit(m: Matrix, cell: Cell) -> str:
    """The engine id whose calibration judges `cell` (judge.yardstick's choice, made from the
    matrix: an engine that fails to measure its calibration is not known here)."""
    t = m.target(cell.target)
    if t.calibrate:
        return cell.engine_id
    healthy = {c.engine_id for c in m.cells() if m.target(c.target).calibrate}
    for o in m.targets:  # the first healthy target, in matrix order, of the same dtype and cache
        eid = dataclasses.replace(cell, target=o.name).engine_id
        if o.name != t.name and eid in healthy:
            return eid
    return cell.engine_id


def shard_cells(m: Matrix, shard: Shard) -> list[Cell]:
    """The cells of shard `shard` of m, in matrix order."""
    return select(m.cells(), shard, lambda c: calibration_unit(m, c))


def shard_info(m: Matrix, shard: Shard) -> ShardInfo:
    """What DIR/shard.json says of shard `shard` of m."""
    cells = m.cells()
    return ShardInfo(
        shard.index,
        shard.count,
        m.name,
        hashlib.sha256(m.text.encode("utf-8")).hexdigest(),
        {p.name: sha256_file(p.path) for p in m.prompt_sets},
        f"tracekit {__version__}",
        tuple(c.id for c in cells),
        tuple(c.id for c in shard_cells(m, shard)),
        {c.id: shard_of(calibration_unit(m, c), shard.count) for c in cells},
    )
