"""`--resume`: complete a trace without ever losing a row it held.

A resume keeps the `ok` rows of `<out>` and sends the other keys. It cannot append to
`<out>` in place (a killed writer's HDF5 file opens for reading only, docs/format.md),
so it moves `<out>` to `<out>.resume-prev`, creates a fresh `<out>`, copies the kept
rows into it and then sends. A kill can land between any two of those steps, so
every step is atomic and `.resume-prev` is never overwritten while it holds rows:

- at start, when `.resume-prev` exists (a resume was killed), its ok rows and those of
  `<out>` (which may hold rows sent after the copy) are both kept: `<out>`'s extra ok
  rows are merged into a new file that replaces `.resume-prev` in one rename;
- `.resume-prev` is removed only after the new `<out>` holds every kept row and was
  closed whole (also after an interrupted run, whose `<out>` is closed cleanly).

So after a kill at any moment, `.resume-prev` and `<out>` together hold every row a
completed request left, and the next `--resume` finds them. A capture without
`--resume` refuses to start while either exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from tracekit.errors import ConfigError
from tracekit.store import TraceReader, TraceWriter, copy_requests

from . import runmeta
from .dialects import RequestSpec

PREV = ".resume-prev"  # <out> moved aside while its kept rows are copied
MERGE = ".resume-merge"  # .resume-prev plus <out>'s extra rows, before it replaces .resume-prev
COPY_BATCH = 256  # rows copied per group commit (a large trace is never held in memory at once)


def prev_path(out: Path) -> Path:
    return out.with_name(out.name + PREV)


def ok_rows(reader: TraceReader) -> dict[str, int]:
    """key -> row of every `ok` row (keys are unique in a trace)."""
    t = reader.requests
    return {k: i for k, i in t.index_by_key().items() if t.status[i] == "ok"}


def check(out: Path, resume: bool, top_logprobs: int, run: dict) -> None:
    """Refuse to start when the run would mix with or overwrite a trace: without --resume,
    `<out>` or a killed resume's `.resume-prev` must not exist; with it, each must hold an
    http capture of the same top-k and configuration (runmeta.RESUME_KEYS)."""
    prev = prev_path(out)
    if not resume:
        if out.exists():
            raise ConfigError(f"{out}: already exists; pass --resume to finish it, or choose another --out")
        if prev.exists():
            raise ConfigError(
                f"{prev}: a killed --resume left the kept rows of {out.name} here; pass --resume to "
                "finish the run, or delete it"
            )
        return
    for path in (prev, out):
        if not path.exists():
            continue
        with TraceReader(path) as r:  # opening recovers a killed trace from its journal
            if r.meta.source != "http" or r.layout.topk != top_logprobs:
                raise ConfigError(
                    f"{path}: cannot --resume: it holds a {r.meta.source} capture with top-k "
                    f"{r.layout.topk}, this run asks for an http capture with --top-logprobs {top_logprobs}"
                )
            runmeta.check_resumable(str(path), r.meta.run, run)


def prepare(out: Path, resume: bool) -> Path | None:
    """Before the new `<out>` is created: the file whose ok rows it keeps (`.resume-prev`), or
    None when there is nothing to keep. Never overwrites `.resume-prev`."""
    if not resume:
        return None
    prev = prev_path(out)
    if not prev.exists():
        if not out.exists():
            return None
        os.replace(out, prev)
        return prev
    if out.exists():
        _merge_into_prev(out, prev)
    return prev


def _merge_into_prev(out: Path, prev: Path) -> None:
    """A killed resume left both files: `<out>`'s ok rows that `.resume-prev` lacks go into a
    copy of `.resume-prev`, which then replaces it (one rename; a kill before it leaves both
    files as they were)."""
    merged = out.with_name(out.name + MERGE)
    with TraceReader(prev) as p, TraceReader(out) as o:
        have = ok_rows(p)
        extra = {k: i for k, i in ok_rows(o).items() if k not in have}
        if not extra:
            return
        with TraceWriter(merged, p.meta, journal=False) as w:
            _copy(p, w, sorted(have.values()))
            _copy(o, w, sorted(extra.values()))
    os.replace(merged, prev)


def _copy(reader: TraceReader, writer: TraceWriter, rows: list[int]) -> int:
    return sum(copy_requests(reader, writer, rows[i : i + COPY_BATCH]) for i in range(0, len(rows), COPY_BATCH))


def copy_kept(prev: Path | None, writer: TraceWriter, specs: list[RequestSpec]) -> tuple[int, list[RequestSpec]]:
    """Copy prev's ok rows into the new trace (each batch flushed and journalled: durable once
    this returns); returns (rows kept, the specs still to send)."""
    if prev is None:
        return 0, specs
    with TraceReader(prev) as r:
        ok = ok_rows(r)
        kept = _copy(r, writer, sorted(ok.values()))
    return kept, [s for s in specs if s.key not in ok]


def done(prev: Path | None, out: Path) -> None:
    """The new `<out>` was closed whole with every kept row: the moved-aside file can go."""
    if prev is not None:
        prev.unlink(missing_ok=True)
    for left in (MERGE, MERGE + ".tmp"):  # a merge a kill interrupted (TraceWriter writes <name>.tmp first)
        out.with_name(out.name + left).unlink(missing_ok=True)
