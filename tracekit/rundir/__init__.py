"""The run directory of `tracekit run` (docs/runner.md, "The run directory"): its layout,
its typed records, and the only code that reads or writes its JSON files.

capture/matrix writes a run through `RunDir`; analyze/ and the CLI read it through
`RunDir` too, so both sides agree on one schema. Every JSON file carries
`"schema": "tracekit.<kind>/<version>"`. A reader checks it like the trace reader
checks `format_version`: a newer version is a clear error naming both versions, an
older one is read by its own function and upgraded in memory, a missing field is an
error, never a guess. A file that cannot be read is an error naming the file and the
field; for a cell's diff the error is kept on the cell (`LoadedCell.diff_error`), so
a corrupt diff.json fails its cell instead of reading as "no diff".

This package knows paths and JSON; it never opens a trace (h5py stays in the store).

The package: `records.py` (the frozen records and the constants of the format),
`parse.py` (JSON -> records, per version, with the upgrade of version 1),
`directory.py` (`RunDir`: the layout, writing, reading).
"""

from .directory import RunDir, read_explain, write_explain
from .parse import read_diff
from .records import (
    DIFF_CLASSES,
    FAILING,
    MANIFEST,
    NOT_DIFFED,
    REPORT,
    VERSION,
    Cell,
    CellRecord,
    Check,
    DiffRef,
    DiffSummary,
    EngineRecord,
    LoadedCell,
    Manifest,
    PairEvidence,
    RunView,
    TeacherRef,
    now_utc,
)

__all__ = [
    "DIFF_CLASSES",
    "FAILING",
    "MANIFEST",
    "NOT_DIFFED",
    "REPORT",
    "VERSION",
    "Cell",
    "CellRecord",
    "Check",
    "DiffRef",
    "DiffSummary",
    "EngineRecord",
    "LoadedCell",
    "Manifest",
    "PairEvidence",
    "RunDir",
    "RunView",
    "TeacherRef",
    "now_utc",
    "read_diff",
    "read_explain",
    "write_explain",
]
