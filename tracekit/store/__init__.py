"""HDF5 store for traces: an append-only SWMR writer and a lazy reader.

Layout (docs/format.md has every dataset): root attributes, `/requests/*`
columns (one row a request; strings as ragged UTF-8 `<name>_bytes` + `<name>_end`
pairs), `/tokens/*` columns (one row a position), `/prompt/token_id`.
This package is the only place that imports h5py.

Modules: `columns` (the column table), `rows` (what the writer refuses),
`writer`, `journal` (write-ahead records), `recovery` (journal -> trace),
`v1` (reading and checking a v1 file), `reader` (TraceReader, version registry).
"""

from __future__ import annotations

from typing import Iterable

from .reader import TraceReader, open_h5, prompt_column, read_token_rows
from .rows import check_request
from .writer import TraceWriter

__all__ = [
    "TraceReader",
    "TraceWriter",
    "check_request",
    "copy_requests",
    "open_h5",
    "prompt_column",
    "read_token_rows",
]


def copy_requests(reader: TraceReader, writer: TraceWriter, rows: Iterable[int]) -> int:
    """Copy request rows (with tokens and prompt ids) into another trace; used by --resume."""
    full = writer.layout.vocab_size > 0
    items = [(reader.record(i), reader.tokens(i, full_logits=full), reader.prompt_ids(i)) for i in rows]
    return writer.append_many(items)
