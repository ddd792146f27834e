"""Shards of a matrix run (`tracekit run MATRIX --shard I/N`, docs/runner.md "Sharding").

A shard runs the cells whose unit hashes to it: shard_of(unit, N) = the first 8 bytes of
sha1(unit, UTF-8) as a big-endian integer, mod N (of crc32, md5, sha1, sha256 and blake2b, the
one that left the fewest shards empty over the shipped matrices at N = 2..4: 3 of 36).
The unit is what a cell's judgement needs (workflows/shards.py: calibration_unit): its engine
configuration, whose groups (serial baselines, calibration repeats) measure the calibration the
cell is judged with; a fault target's cells go with the healthy engine whose calibration they
borrow. So a cell's group is never split and every calibration is measured from the same
repeats as in an unsharded run. The choice depends only on the unit's id and N, so every shard
of every scheduler agrees without talking to the others, and adding cells to the matrix moves
no existing cell to another shard. The price: units are spread by hash, balanced on average
only (bench/RESULTS.md, "shard_bench.py").

Each shard is a complete run directory; its `shard.json` (written when the shard starts,
so a killed shard still says what it is) names the shard, the matrix (name, sha256 of the
file, sha256 of each prompt set) and the cells the shard owns. The manifest repeats it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..errors import ConfigError, TraceFormatError
from .records import Cell

SHARD_JSON = "shard.json"
SHARD_SCHEMA = "tracekit.shard/1"
ASSIGNMENT = "sha1(calibration unit: the engine configuration whose calibration judges the cell)[:8] mod count"
_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    index: int  # 0-based: SLURM_ARRAY_TASK_ID (with --array=0-(N-1)), JOB_COMPLETION_INDEX
    count: int

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """'I/N' with 0 <= I < N; ConfigError saying what is expected otherwise."""
    m = _SPEC.match(text or "")
    if not m:
        raise ConfigError(f"--shard {text!r}: expected I/N, e.g. 0/4 (I counts from 0)")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or i >= n:
        raise ConfigError(f"--shard {text}: I must be 0..N-1 and N >= 1 (shards are numbered from 0)")
    return Shard(i, n)


def shard_of(unit: str, count: int) -> int:
    """The shard (0..count-1) that runs every cell of this unit."""
    return int.from_bytes(hashlib.sha1(unit.encode("utf-8")).digest()[:8], "big") % count


def select(cells: Iterable[Cell], shard: Shard, unit: Callable[[Cell], str] | None = None) -> list[Cell]:
    """The cells of `shard`, in matrix order; `unit` names each cell's unit (default: its engine
    configuration, which holds its group)."""
    unit = unit or (lambda c: c.engine_id)
    return [c for c in cells if shard_of(unit(c), shard.count) == shard.index]


@dataclass(frozen=True)
class ShardInfo:
    """shard.json: which shard of which matrix a run directory holds."""

    index: int
    count: int
    matrix_name: str
    matrix_sha256: str  # of the matrix file as read (DIR/matrix.toml)
    prompts_sha256: Mapping[str, str]  # prompt set name -> sha256 of its JSONL
    tool: str  # "tracekit <version>"
    matrix_cells: tuple[str, ...]  # every cell of the matrix, in matrix order
    cells: tuple[str, ...]  # this shard's cells, in matrix order
    cell_shards: Mapping[str, int]  # every cell of the matrix -> its shard (the merge names a missing shard's)

    @property
    def shard(self) -> Shard:
        return Shard(self.index, self.count)

    def to_json(self) -> dict:
        return {
            "schema": SHARD_SCHEMA,
            "index": self.index,
            "count": self.count,
            "matrix": {"name": self.matrix_name, "sha256": self.matrix_sha256, "prompts": dict(self.prompts_sha256)},
            "tool": self.tool,
            "assignment": ASSIGNMENT,
            "matrix_cells": list(self.matrix_cells),
            "cells": list(self.cells),
            "cell_shards": dict(self.cell_shards),
        }

    @classmethod
    def from_json(cls, doc, where: str) -> "ShardInfo":
        try:
            if doc.get("schema") != SHARD_SCHEMA:
                raise TraceFormatError(f"{where}: schema {doc.get('schema')!r} is not {SHARD_SCHEMA}")
            mx = doc["matrix"]
            return cls(
                int(doc["index"]),
                int(doc["count"]),
                str(mx["name"]),
                str(mx["sha256"]),
                {str(k): str(v) for k, v in mx["prompts"].items()},
                str(doc["tool"]),
                tuple(map(str, doc["matrix_cells"])),
                tuple(map(str, doc["cells"])),
                {str(k): int(v) for k, v in doc["cell_shards"].items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise TraceFormatError(f"{where}: not a {SHARD_SCHEMA} document ({type(e).__name__}: {e})") from None
