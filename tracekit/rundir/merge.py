"""Merge shard directories (`tracekit report S0 S1 ... --out DIR`) into one run directory.

The merged directory is an ordinary run directory (its cells, groups, engines, a manifest),
so `tracekit report`, `explain` and `stats` read it like an unsharded run. Files are
hard-linked from the shards (copied where the file system cannot link), never rewritten;
the shards stay as they were. The merge refuses, with one line, shards of different
matrices (the matrix file's or a prompt set's sha256), of different shard counts, written
by different tracekit versions, or one shard given twice. Shards that are absent, or that
stopped before their manifest (killed, failed), are kept in the manifest's `merged` record
with every cell that is missing, so the report names them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, UsageError
from ..files import sha256_file
from .directory import RunDir
from .records import MANIFEST, MATRIX_COPY, REPORT, EngineRecord, Manifest, now_utc
from .shards import ASSIGNMENT, SHARD_JSON, ShardInfo


class MergeRefused(UsageError):
    """The directories given cannot be merged (not shards, of different matrices, ...): a usage error."""


@dataclass(frozen=True)
class ShardState:
    index: int
    dir: str
    complete: bool  # the shard wrote its manifest (it finished)
    cells: tuple[str, ...]  # its cells present in the merge (cell.json written)
    missing: tuple[str, ...]  # its cells absent

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "cells": list(self.cells), "missing": list(self.missing)}


@dataclass(frozen=True)
class Merged:
    root: Path
    count: int
    shards: tuple[ShardState, ...]  # the shards given, by index
    missing_shards: tuple[int, ...]
    missing_cells: tuple[str, ...]  # every cell of the matrix without a cell.json, in matrix order

    @property
    def complete(self) -> bool:
        return not self.missing_shards and not self.missing_cells and all(s.complete for s in self.shards)


def _read(d: str | os.PathLike) -> tuple[RunDir, ShardInfo]:
    rd = RunDir(d)
    if not rd.root.is_dir():
        raise MergeRefused(f"{rd.root}: no such directory")
    info = rd.read_shard()
    if info is None:
        what = "a run of a whole matrix" if (rd.root / MATRIX_COPY).is_file() else "not a run directory"
        raise MergeRefused(
            f"{rd.root}: not a shard (no {SHARD_JSON}: {what}); merge directories of `tracekit run --shard I/N`, "
            f"or report a whole run alone with `tracekit report {rd.root}`"
        )
    return rd, info


def check_compatible(shards: list[tuple[RunDir, ShardInfo]]) -> None:
    """ConfigError (one line) unless every shard is of one matrix, one shard count, one tracekit."""
    rd0, s0 = shards[0]
    seen: dict[int, Path] = {}
    for rd, s in shards:
        if s.matrix_sha256 != s0.matrix_sha256:
            raise MergeRefused(
                f"{rd.root} is a shard of matrix {s.matrix_name!r} (sha256 {s.matrix_sha256[:12]}), {rd0.root} of "
                f"matrix {s0.matrix_name!r} (sha256 {s0.matrix_sha256[:12]}): shards of different matrices are "
                "never merged"
            )
        diff = sorted(
            k for k in {*s.prompts_sha256, *s0.prompts_sha256} if s.prompts_sha256.get(k) != s0.prompts_sha256.get(k)
        )
        if diff:
            raise MergeRefused(
                f"{rd.root} and {rd0.root} ran different prompt sets under the same names ({', '.join(diff)}: "
                "sha256 differs): shards of different inputs are never merged"
            )
        if s.count != s0.count:
            raise MergeRefused(
                f"{rd.root} is shard {s.index}/{s.count}, {rd0.root} shard {s0.index}/{s0.count}: "
                "merge shards of one split (the same N)"
            )
        if s.tool != s0.tool:
            raise MergeRefused(
                f"{rd.root} was written by {s.tool}, {rd0.root} by {s0.tool}: merge shards of one tracekit "
                "version (rerun the others with it)"
            )
        if s.index in seen:
            raise MergeRefused(f"{seen[s.index]} and {rd.root} are both shard {s.shard.label}: give each shard once")
        seen[s.index] = rd.root


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)


def merge(dirs: list[str | os.PathLike], out: str | os.PathLike, command: str) -> Merged:
    """Merge the shard directories `dirs` into the new run directory `out`."""
    if not dirs:
        raise ConfigError("no shard directory given")
    shards = sorted((_read(d) for d in dirs), key=lambda x: x[1].index)
    check_compatible(shards)
    rd0, s0 = shards[0]
    dst = RunDir.create(out, (rd0.root / MATRIX_COPY).read_text(encoding="utf-8"))
    files: dict[str, str] = {MATRIX_COPY: sha256_file(dst.path(MATRIX_COPY))}
    engines: list[EngineRecord] = []
    states, present = [], set()
    mans: dict[int, Manifest] = {}
    for rd, s in shards:
        man = rd.read_manifest()
        known = dict(man.files) if man is not None else {}
        renamed: dict[str, str] = {}
        for p in sorted(rd.root.rglob("*")):
            rel = p.relative_to(rd.root).as_posix()
            if not p.is_file() or rel in (MANIFEST, SHARD_JSON, MATRIX_COPY) or rel.split("/")[0] == REPORT:
                continue
            to = rel
            if dst.path(to).exists():  # one engine configuration started by two shards: keep both
                stem, dot, ext = rel.rpartition(".")
                to = renamed.setdefault(rel, f"{stem}@shard{s.index}{dot}{ext}")
            _link(p, dst.path(to))
            files[to] = known.get(rel) or sha256_file(p)
            if to != rel:
                renamed[rel] = to
        recs = list(man.engines) if man is not None else rd.read_engines()
        for e in recs:
            if f"engines/{e.engine_id}.json" in renamed:
                e = dataclasses.replace(e, engine_id=f"{e.engine_id}@shard{s.index}", log=renamed.get(e.log, e.log))
            engines.append(e)
        have = tuple(c for c in s.cells if dst.path(f"cells/{c}/cell.json").is_file())
        present.update(have)
        states.append(
            ShardState(s.index, str(rd.root), man is not None, have, tuple(c for c in s.cells if c not in have))
        )
        if man is not None:
            mans[s.index] = man
    given = {s.index for s in states}
    missing_shards = tuple(i for i in range(s0.count) if i not in given)
    missing_cells = tuple(c for c in s0.matrix_cells if c not in present)
    merged = Merged(dst.root, s0.count, tuple(states), missing_shards, missing_cells)
    first = next(iter(mans.values()), None)
    done = list(mans.values())
    dst.write_manifest(
        Manifest(
            s0.tool,
            first.git_commit if first else None,
            command,
            dict(first.host) if first else {},
            min((m.started_utc for m in done), default=now_utc()),
            max((m.finished_utc for m in done), default=now_utc()),
            s0.matrix_name,
            first.matrix_path if first else MATRIX_COPY,
            tuple(c for c in s0.matrix_cells if c in present),
            tuple(engines),
            files,
            matrix_sha256=s0.matrix_sha256,
            merged={
                "count": s0.count,
                "assignment": ASSIGNMENT,
                "shards": [st.to_json() | _when(mans.get(st.index)) for st in states],
                "missing_shards": list(missing_shards),
                "missing_shard_cells": {
                    str(i): [c for c in s0.matrix_cells if s0.cell_shards.get(c) == i] for i in missing_shards
                },
                "missing_cells": list(missing_cells),
                "matrix_cells": list(s0.matrix_cells),
            },
        )
    )
    return merged


def _when(m: Manifest | None) -> dict:
    if m is None:
        return {}
    return {"host": m.host.get("hostname"), "git_commit": m.git_commit, "started_utc": m.started_utc,
            "finished_utc": m.finished_utc}  # fmt: skip
