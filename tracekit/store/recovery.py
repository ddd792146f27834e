"""Rebuild a trace whose writer was killed, from its write-ahead journal.

Lives apart from `journal.py` (records, no HDF5) and `writer.py` (which writes
the journal) so that neither imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..schema import Layout, RunMeta
from .journal import journal_path, read_journal
from .writer import TraceWriter


def recover(trace: str | os.PathLike) -> int:
    """Rebuild `trace` from its journal (atomically replacing the killed file);
    returns the number of requests recovered."""
    jpath = journal_path(trace)
    meta, items = read_journal(jpath)
    if not meta:
        raise FileNotFoundError(jpath)
    rm = RunMeta(
        source=meta["source"], run=meta["run"], layout=Layout(**meta["layout"]), created_utc=meta["created_utc"]
    )
    tmp = Path(f"{os.fspath(trace)}.recovered.{os.getpid()}")  # two readers may recover at once
    with TraceWriter(tmp, rm, journal=False) as w:
        w.append_many(items)
    os.replace(tmp, trace)
    jpath.unlink(missing_ok=True)
    return len(items)
