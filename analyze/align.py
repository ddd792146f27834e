"""Pair two traces' requests by key and lay their token rows side by side.

Reads the request tables, the 1-D token columns (token_id, logprob) and the
prompt ids; top-k rows are fetched later by the classifier, at divergence
positions only. This module decides *which* rows are compared and whether a
pair is comparable at all; it does not classify (classify.py) or print
(report.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tracekit.errors import AlignmentError, ConfigError
from tracekit.schema import RequestTable, RunMeta
from tracekit.store import TraceReader, prompt_column

from .streams import Asked, asked, sampled_reason

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
    """One trace after row selection; token columns are whole-file arrays."""

    path: str
    meta: RunMeta
    table: RequestTable
    rows: np.ndarray  # [R] int64: selected request rows, one per key
    token_id: np.ndarray  # [N] int32: the whole token_id column
    logprob: np.ndarray  # [N] float32: the whole logprob column
    prompt: np.ndarray  # [M] int32: all prompt ids, concatenated
    reader: TraceReader
    note: str = ""  # repeated keys, said in every output


def _select_rows(reader: TraceReader, select: dict[str, str], label: str) -> tuple[np.ndarray, str]:
    """(one row per key, a note naming repeated keys or ''). A repeated key in an
    HTTP trace (a resumed run, a re-sent prompt) keeps its last row, and says so:
    rows never collapse silently."""
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
    uniq, last, counts = np.unique(keys[::-1], return_index=True, return_counts=True)
    if len(uniq) == len(keys):
        return rows, ""
    if reader.meta.source == "teacher_forced":
        raise AlignmentError(
            f"{reader.path} holds several teacher-forced rows per key{_choices(t)}; "
            f"pick one with --{label}-select history=H,dtype=D"
        )
    rep = counts > 1
    shown = ", ".join(f"{k} x{c}" for k, c in zip(uniq[rep][:5].tolist(), counts[rep][:5].tolist()))
    more = f" and {int(rep.sum()) - 5} more" if rep.sum() > 5 else ""
    note = (
        f"{label.upper()} ({reader.path}): {int(rep.sum())} key(s) appear more than once "
        f"({shown}{more}, {int(counts[rep].sum())} rows); the last row of each is compared"
    )
    return np.sort(rows[len(rows) - 1 - last]), note


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


def load_side(reader: TraceReader, select: dict[str, str] | None = None, label: str = "a") -> Side:
    """Select rows and read the compared columns. In a teacher-forced trace the
    stored token_id is the replayed (forced) token, the same in every history;
    what a history *predicts* is its top-1, so that is what gets compared."""
    rows, note = _select_rows(reader, select or {}, label)
    if reader.meta.source == "teacher_forced":
        logits = reader.column("topk_logit") if reader.has_column("topk_logit") else None
        token_id, logprob = top1(reader.column("topk_id"), reader.column("topk_logprob"), logits)
    else:
        cols = reader.columns(["token_id", "logprob"])
        token_id, logprob = cols["token_id"], cols["logprob"]
    return Side(reader.path, reader.meta, reader.requests, rows, token_id, logprob, prompt_column(reader), reader, note)


def chosen_logits(side: Side) -> np.ndarray:
    """[N] the raw logit of each chosen token (NaN where not in its top-k row)."""
    r = side.reader
    ids, lg = r.column("topk_id"), r.column("topk_logit")
    hit = (ids == side.token_id[:, None]) & (ids >= 0)
    j = hit.argmax(1)
    return np.where(hit.any(1), lg[np.arange(len(ids)), j], np.nan).astype(np.float32)


def drift_values(a: Side, b: Side) -> tuple[Side, Side, str]:
    """The values drift is measured on: the chosen logprobs, or, when a trace
    stores none (vLLM --logprobs-mode raw_logits puts logits in their place) and
    both stored raw logits, the chosen tokens' raw logits on both sides (read
    whole only then). Returns the sides and a note ('' for logprobs)."""
    if all(np.isfinite(s.logprob).any() or not len(s.logprob) for s in (a, b)):
        return a, b, ""
    if not (a.reader.has_column("topk_logit") and b.reader.has_column("topk_logit")):
        return a, b, ""
    a = dataclasses.replace(a, logprob=chosen_logits(a))
    b = dataclasses.replace(b, logprob=chosen_logits(b))
    return a, b, "drift is measured on the chosen tokens' raw logits: a trace stores no logprobs"


def segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For P segments of the given lengths: (seg [T] segment of each row, pos [T]
    position inside its segment, start [P] first row of each segment)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    start = np.cumsum(lengths) - lengths
    seg = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(int(lengths.sum()), dtype=np.int64) - start[seg]
    return seg, pos, start


@dataclass(frozen=True)
class Alignment:
    """Every key of A (in A's order), then keys only in B. Per pair [P]: the
    request rows (-1 = missing), why it is incomparable ('' = comparable: not
    missing, not failed, same prompt, not sampled, token ids known), and
    for comparable pairs the token offsets and compared length L = min(n_a, n_b).
    Concatenated over comparable pairs [T]: seg, pos, idx_a, idx_b."""

    a: Side
    b: Side
    keys: np.ndarray  # [P] object
    row_a: np.ndarray  # [P] int64, -1 = missing
    row_b: np.ndarray
    incomparable: np.ndarray  # [P] object: reason, '' when comparable
    n_a: np.ndarray  # [P] int64 output lengths (0 when missing)
    n_b: np.ndarray
    off_a: np.ndarray  # [P] int64 first token row
    off_b: np.ndarray
    length: np.ndarray  # [P] int64 compared length (0 for incomparable pairs)
    seg: np.ndarray  # [T] int64
    pos: np.ndarray  # [T] int64
    start: np.ndarray  # [P] int64 first concatenated row of each pair
    idx_a: np.ndarray  # [T] int64 token row in A
    idx_b: np.ndarray
    asked_a: tuple[Asked, ...] = ()  # [P] what each request asked (streams.py)
    asked_b: tuple[Asked, ...] = ()


def _pair_keys(a: Side, b: Side) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys_a = a.table.key[a.rows]
    keys_b = b.table.key[b.rows]
    where_b = {k: int(r) for k, r in zip(keys_b.tolist(), b.rows.tolist())}
    in_a = set(keys_a.tolist())
    only_b = [(k, r) for k, r in zip(keys_b.tolist(), b.rows.tolist()) if k not in in_a]
    keys = np.array(keys_a.tolist() + [k for k, _ in only_b], dtype=object)
    row_a = np.concatenate([a.rows, np.full(len(only_b), -1)]).astype(np.int64)
    row_b = np.array([where_b.get(k, -1) for k in keys_a.tolist()] + [r for _, r in only_b], dtype=np.int64)
    return keys, row_a, row_b


def _status_reason(side: Side, rows: np.ndarray, label: str) -> np.ndarray:
    t = side.table
    out = np.full(len(rows), "", dtype=object)
    for i in np.flatnonzero(t.status[rows] != "ok"):
        r = rows[i]
        http = f" HTTP {t.http_status[r]}" if t.http_status[r] > 0 else ""
        err = f": {t.error[r][:80]}" if t.error[r] else ""
        out[i] = f"{label} status {t.status[r]}{http}{err}"
    return out


def _prompt_reason(a: Side, b: Side, ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
    """Why prompts differ ('' = same). Ids are authoritative when both sides have
    them (a text prompt and its ids hash differently); else compare prompt_hash."""
    ta, tb = a.table, b.table
    pa, pb = ta.prompt_len[ra].astype(np.int64), tb.prompt_len[rb].astype(np.int64)
    out = np.full(len(ra), "", dtype=object)
    known = (pa >= 0) & (pb >= 0)
    for i in np.flatnonzero(known & (pa != pb)):
        out[i] = f"different prompts: {pa[i]} vs {pb[i]} tokens"
    same = np.flatnonzero(known & (pa == pb))
    seg, pos, _ = segments(pa[same])
    diff = a.prompt[ta.prompt_offset[ra[same]][seg] + pos] != b.prompt[tb.prompt_offset[rb[same]][seg] + pos]
    bad = np.bincount(seg[diff], minlength=len(same)) > 0
    for i, j in zip(same[bad].tolist(), np.unique(seg[diff], return_index=True)[1].tolist()):
        out[i] = f"different prompts: token ids differ at prompt position {int(pos[diff][j])}"
    hashed = np.flatnonzero(~known & (ta.prompt_hash[ra] != tb.prompt_hash[rb]))
    for i in hashed:
        out[i] = "different prompts (prompt_hash differs)"
    return out


def align(a: Side, b: Side) -> Alignment:
    keys, row_a, row_b = _pair_keys(a, b)
    if not len(keys):
        raise AlignmentError(f"{a.path} and {b.path} hold no requests: nothing to compare")
    if not np.any((row_a >= 0) & (row_b >= 0)):
        raise AlignmentError(
            f"{a.path} and {b.path} have no request key in common: they are not runs of "
            f"the same prompt set (or the row selection excludes every key)"
        )
    reason = np.full(len(keys), "", dtype=object)
    reason[row_b < 0] = "missing in B"
    reason[row_a < 0] = "missing in A"
    both = np.flatnonzero((row_a >= 0) & (row_b >= 0))
    for rsn in (
        _status_reason(a, row_a[both], "A"),
        _status_reason(b, row_b[both], "B"),
        _prompt_reason(a, b, row_a[both], row_b[both]),
    ):
        fill = (reason[both] == "") & (rsn != "")
        reason[both[fill]] = rsn[fill]

    def get(side, rows, col):
        return np.where(rows >= 0, getattr(side.table, col)[np.maximum(rows, 0)], 0).astype(np.int64)

    n_a, n_b = get(a, row_a, "n_tokens"), get(b, row_b, "n_tokens")
    off_a, off_b = get(a, row_a, "token_offset"), get(b, row_b, "token_offset")
    asked_a, asked_b = asked(a, row_a), asked(b, row_b)
    for i in np.flatnonzero(reason == "").tolist():
        reason[i] = sampled_reason(asked_a[i], asked_b[i])
    length = np.where(reason == "", np.minimum(n_a, n_b), 0)
    unknown = _unknown_ids_reason(a, b, length, off_a, off_b)
    reason[unknown != ""] = unknown[unknown != ""]
    length = np.where(reason == "", length, 0)
    seg, pos, start = segments(length)
    return Alignment(
        a,
        b,
        keys,
        row_a,
        row_b,
        reason,
        n_a,
        n_b,
        off_a,
        off_b,
        length,
        seg,
        pos,
        start,
        off_a[seg] + pos,
        off_b[seg] + pos,
        tuple(asked_a),
        tuple(asked_b),
    )


def _unknown_ids_reason(a: Side, b: Side, length, off_a, off_b) -> np.ndarray:
    """Token id -1 (unknown: the engine sent token strings and capture had no
    tokenizer) never equals anything: such a pair cannot be compared by ids."""
    seg, pos, _ = segments(length)
    out = np.full(len(length), "", dtype=object)
    for label, side, off in (("A", a, off_a), ("B", b, off_b)):
        bad = side.token_id[off[seg] + pos] < 0
        cnt = np.bincount(seg[bad], minlength=len(length))
        for i in np.flatnonzero((cnt > 0) & (out == "")).tolist():
            out[i] = (
                f"token ids unknown (-1) at {cnt[i]} of {length[i]} positions of {label}: the engine sent "
                "token strings only and capture had no tokenizer (recapture with --tokenizer DIR)"
            )
    return out
