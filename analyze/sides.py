"""One side of a comparison: a trace's selected rows and its compared columns.

Reads the request table, the 1-D token columns (token_id, logprob), the prompt
ids and, to check the chosen logprob column against what the top-k rows say
for the same token, the top-k ids and logprobs: in one blocked pass that also
makes the reported-row checks (rowscan.py); raw logits only when drift must be
measured on them. Which rows: one per key (`--a-select` / `--b-select` pick
teacher-forced rows); a key answered `ok` more than once is ambiguous and said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tracekit.errors import AlignmentError, ConfigError
from tracekit.rowcheck import pick
from tracekit.schema import RequestTable, RunMeta
from tracekit.store import TraceReader, prompt_column

from .rowscan import RowScan, scan

# Request columns a --a-select/--b-select filter may name.
SELECTABLE = ("history", "dtype", "finish_reason", "status")


def parse_select(text: str | None) -> dict[str, str]:
    """'history=full,dtype=fp32' -> {'history': 'full', 'dtype': 'fp32'}."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SELECTABLE:
            raise ConfigError(
                f"bad row selection {part!r}: expected NAME=VALUE with NAME one of "
                f"{', '.join(SELECTABLE)} (e.g. history=full,dtype=fp32)"
            )
        out[name] = value.strip()
    return out


@dataclass(frozen=True)
class Side:
    """One trace after row selection; token columns are whole-file arrays [N]."""

    path: str
    meta: RunMeta
    table: RequestTable
    rows: np.ndarray  # [R] int64: selected request rows, one per key
    token_id: np.ndarray  # [N] int32: the compared token (teacher-forced: the history's top-1)
    logprob: np.ndarray  # [N] float32: its logprob as the column stores it (NaN = not recorded)
    topk_lp: np.ndarray | None  # [N] float32: its entry in its own top-k row (NaN = absent; None: not scanned)
    prompt: np.ndarray  # [M] int32: all prompt ids, concatenated
    reader: TraceReader
    note: str = ""  # repeated keys, said in every output
    ambiguous: frozenset = frozenset()  # keys answered ok more than once: {key: "why"}
    replayed: np.ndarray | None = None  # [N] teacher-forced: the replayed (forced) token ids
    scan: RowScan | None = None  # HTTP traces: what every top-k row says (rowscan.py; reported.py checks it)
    request_rows: np.ndarray | None = None  # a window's table: each row's request row in the file (stream.py)

    @property
    def has_logits(self) -> bool:
        return self.reader.has_column("topk_logit")

    def chosen_logits(self) -> np.ndarray:
        """[N] the raw logit of each compared token in its own top-k row (NaN where
        absent). Reads the [N, k] logit column whole: only when drift needs it."""
        r = self.reader
        ids, lg = r.column("topk_id"), r.column("topk_logit")
        return pick(ids, lg, self.token_id)


def _select_rows(reader: TraceReader, select: dict[str, str], label: str) -> tuple[np.ndarray, str, frozenset]:
    """(one row per key, a note naming repeated keys or '', keys answered ok more
    than once). A repeated key in an HTTP trace keeps its last ok row (a resumed
    run replaces failed rows), else its last row; it is never collapsed silently,
    and two ok answers to one key make that pair incomparable (which one?)."""
    t = reader.requests
    keep = np.ones(len(t), dtype=bool)
    for name, value in select.items():
        keep &= getattr(t, name) == value
    rows = np.flatnonzero(keep)
    if len(t) and not len(rows):
        raise AlignmentError(
            f"{reader.path}: no request row matches --{label}-select "
            f"{','.join(f'{k}={v}' for k, v in select.items())}{_choices(t)}"
        )
    keys = t.key[rows]
    uniq, counts = np.unique(keys, return_counts=True)
    if len(uniq) == len(keys):
        return rows, "", frozenset()
    if reader.meta.source == "teacher_forced":
        raise AlignmentError(
            f"{reader.path} holds several teacher-forced rows per key{_choices(t)}; "
            f"pick one with --{label}-select history=H,dtype=D"
        )
    chosen: dict[str, int] = {}
    oks: dict[str, int] = {}
    for r in rows.tolist():  # later rows win; an ok row wins over a failed one
        k, ok = t.key[r], t.status[r] == "ok"
        oks[k] = oks.get(k, 0) + ok
        if ok or k not in chosen or t.status[chosen[k]] != "ok":
            chosen[k] = r
    rep = counts > 1
    shown = ", ".join(f"{k} x{c}" for k, c in zip(uniq[rep][:5].tolist(), counts[rep][:5].tolist()))
    more = f" and {int(rep.sum()) - 5} more" if rep.sum() > 5 else ""
    ambiguous = frozenset(k for k, n in oks.items() if n > 1)
    note = (
        f"{label.upper()} ({reader.path}): {int(rep.sum())} key(s) appear more than once "
        f"({shown}{more}, {int(counts[rep].sum())} rows); the last ok row of each is compared"
        + (f"; {len(ambiguous)} key(s) have several ok answers and are incomparable" if ambiguous else "")
    )
    return np.array(sorted(chosen.values()), dtype=np.int64), note, ambiguous


def _choices(t: RequestTable) -> str:
    combos = sorted({f"history={h},dtype={d}" for h, d in zip(t.history, t.dtype) if h or d})
    return f" (it has: {'; '.join(combos)})" if combos else ""


def top1(ids: np.ndarray, lps: np.ndarray, logits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of [N, k] top-k columns: the id with the largest raw logit (the
    logprob where a row has no logits) and its logprob. -1 / NaN for empty rows."""
    score = lps.astype(np.float64)
    if logits is not None:
        has = ~np.isnan(logits).all(1, keepdims=True)
        score = np.where(has, logits, score)
    score = np.where(np.isnan(score) | (ids < 0), -np.inf, score)
    if not ids.shape[1]:
        return np.full(len(ids), -1, np.int32), np.full(len(ids), np.nan, np.float32)
    j = score.argmax(1)
    r = np.arange(len(ids))
    empty = np.isneginf(score[r, j])
    return np.where(empty, -1, ids[r, j]).astype(np.int32), np.where(empty, np.nan, lps[r, j]).astype(np.float32)


def load_side(
    reader: TraceReader, select: dict[str, str] | None = None, label: str = "a", scan_rows: bool = True
) -> Side:
    """Select rows and read the compared columns. In a teacher-forced trace the
    stored token_id is the replayed (forced) token, the same in every history;
    what a history *predicts* is its top-1, so that is what gets compared.
    scan_rows=False: an HTTP trace's top-k pass is left for `scanned` (topk_lp and scan
    are None until then), which the diff runs once it knows the rows it must keep."""
    rows, note, ambiguous = _select_rows(reader, select or {}, label)
    replayed, rows_scan = None, None
    if reader.meta.source == "teacher_forced":
        ids, lps = reader.column("topk_id"), reader.column("topk_logprob")
        logits = reader.column("topk_logit") if reader.has_column("topk_logit") else None
        token_id, logprob = top1(ids, lps, logits)
        replayed = reader.column("token_id")
        topk_lp = pick(ids, lps, token_id)
    else:  # the top-k columns in one blocked pass: the chosen token's entry and the row checks
        cols = reader.columns(["token_id", "logprob"])
        token_id, logprob = cols["token_id"], cols["logprob"]
        topk_lp = None
        if scan_rows:
            rows_scan = scan(reader, token_id, logprob)
            topk_lp = rows_scan.topk_lp if rows_scan is not None else np.full(len(token_id), np.nan, np.float32)
    return Side(
        reader.path,
        reader.meta,
        reader.requests,
        rows,
        token_id,
        logprob,
        topk_lp,
        prompt_column(reader),
        reader,
        note,
        ambiguous,
        replayed,
        rows_scan,
    )


def header_side(reader: TraceReader, select: dict[str, str] | None = None, label: str = "a") -> Side:
    """The request side of a trace without its token rows (zero-length token columns): the
    selected rows, their notes and the run metadata, for a diff that reads its token rows a
    window at a time (stream.py)."""
    rows, note, ambiguous = _select_rows(reader, select or {}, label)
    none = np.zeros(0, np.int32)
    f32 = np.zeros(0, np.float32)
    return Side(reader.path, reader.meta, reader.requests, rows, none, f32, f32, none, reader, note, ambiguous)


def window_side(side: Side, rows: np.ndarray, prompt: np.ndarray, columns: dict, table, reader, req) -> Side:
    """`side` (a header_side) over a window of its requests: `rows` the selected rows in the
    window's table, token columns and table of the window (window.py), the prompt ids whole;
    req: the file's request row of each row of the window's table."""
    return dataclasses.replace(
        side,
        table=table,
        rows=rows,
        token_id=columns["token_id"],
        logprob=columns["logprob"],
        topk_lp=None,
        prompt=prompt,
        reader=reader,
        scan=None,
        request_rows=req,
    )


def scanned(side: Side, keep: np.ndarray) -> Side:
    """`side` after its top-k pass (rowscan.scan), keeping the top-k rows of token rows `keep`
    (the first differences: classify reads them from the pass instead of the file again). A
    side that is already scanned (teacher-forced, or loaded with scan_rows) is returned as is."""
    if side.topk_lp is not None:
        return side
    rs = scan(side.reader, side.token_id, side.logprob, keep)
    topk_lp = rs.topk_lp if rs is not None else np.full(len(side.token_id), np.nan, np.float32)
    return dataclasses.replace(side, topk_lp=topk_lp, scan=rs)
