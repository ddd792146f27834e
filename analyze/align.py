"""Pair two traces' requests by key and lay their token rows side by side.

The sides (sides.py) hold each trace's selected rows and columns. This module
decides which rows are compared and whether a pair is comparable at all:
missing, failed, an ambiguous key, different prompts, sampled, asked
differently, a teacher-forced replay of other tokens, unknown token ids. It
does not classify (classify.py) or print (diff_report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracekit.errors import AlignmentError

from .sides import Side, load_side, parse_select, top1
from .streams import Asked, asked, requests_differ, sampled_reason

__all__ = ["Alignment", "Side", "align", "load_side", "pair_keys", "parse_select", "segments", "top1"]


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
    # positions.first_divergence's (t, ta, tb), kept by positions.with_scans (the sides' token ids
    # do not change there): classify reads it again instead of taking [T] ids twice
    first: tuple | None = field(default=None, compare=False, repr=False)

    def per_row(self, x: np.ndarray) -> np.ndarray:
        """x[seg] for a [P] array: each pair's value at each of its compared rows (a repeat, a
        fifth of a take's cost)."""
        return np.repeat(x, self.length) if len(self.seg) == int(self.length.sum()) else x[self.seg]

    def take_a(self, x: np.ndarray) -> np.ndarray:
        """x[idx_a] (a fresh array) for a [N] column of A's token rows (take)."""
        return take(x, self.idx_a, self.off_a, self.length)

    def take_b(self, x: np.ndarray) -> np.ndarray:
        """x[idx_b] (a fresh array) for a [N] column of B's token rows (take)."""
        return take(x, self.idx_b, self.off_b, self.length)


RUN_ROWS = 256  # the least mean run length that copies by slices (a fancy take is ~10x a memcpy)


def take(x: np.ndarray, idx: np.ndarray, off: np.ndarray, length: np.ndarray) -> np.ndarray:
    """x[idx] for idx = off[seg] + pos (Alignment.idx_a / idx_b), the same array: copied run by
    run where consecutive pairs' token rows follow each other in the trace (two runs of one
    prompt set in the same order: a few long runs), a fancy take otherwise."""
    nz = np.flatnonzero(length > 0)
    if not len(nz) or len(idx) != int(length.sum()):
        return x[idx]
    o, n = off[nz], length[nz]
    new = np.empty(len(nz), bool)
    new[0] = True
    np.not_equal(o[1:], o[:-1] + n[:-1], out=new[1:])
    first = np.flatnonzero(new)
    if len(first) * RUN_ROWS > len(idx) or (o + n).max() > len(x) or o.min() < 0:
        return x[idx]  # short runs; or rows outside x: the take raises as it would
    src, size = o[first], np.add.reduceat(n, first)
    out = np.empty((len(idx),) + x.shape[1:], x.dtype)
    d = 0
    for s, m in zip(src.tolist(), size.tolist()):
        out[d : d + m] = x[s : s + m]
        d += m
    return out


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
    known = (pa > 0) & (pb > 0)  # no prompt is empty: 0 stored ids say nothing, use the hash
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


def pair_keys(a: Side, b: Side) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys [P], row_a, row_b): the pairs of two sides, checked (something in common)."""
    keys, row_a, row_b = _pair_keys(a, b)
    if not len(keys):
        raise AlignmentError(f"{a.path} and {b.path} hold no requests: nothing to compare")
    if not np.any((row_a >= 0) & (row_b >= 0)):
        raise AlignmentError(
            f"{a.path} and {b.path} have no request key in common: they are not runs of "
            f"the same prompt set (or the row selection excludes every key)"
        )
    return keys, row_a, row_b


def align(a: Side, b: Side, whole: bool = True) -> Alignment:
    """The pairs of a and b. whole=False: a and b are windows of traces whose pairs were
    checked whole (stream.py): a window may hold only keys missing on one side."""
    keys, row_a, row_b = pair_keys(a, b) if whole else _pair_keys(a, b)
    reason = np.full(len(keys), "", dtype=object)
    reason[row_b < 0] = "missing in B"
    reason[row_a < 0] = "missing in A"
    both = np.flatnonzero((row_a >= 0) & (row_b >= 0))
    for rsn in (
        _status_reason(a, row_a[both], "A"),
        _status_reason(b, row_b[both], "B"),
        _ambiguous_reason(a, b, keys[both], row_a[both], row_b[both]),
        _prompt_reason(a, b, row_a[both], row_b[both]),
    ):
        fill = (reason[both] == "") & (rsn != "")
        reason[both[fill]] = rsn[fill]

    def get(side, rows, col):
        return np.where(rows >= 0, getattr(side.table, col)[np.maximum(rows, 0)], 0).astype(np.int64)

    n_a, n_b = get(a, row_a, "n_tokens"), get(b, row_b, "n_tokens")
    off_a, off_b = get(a, row_a, "token_offset"), get(b, row_b, "token_offset")
    asked_a, asked_b = asked(a, row_a), asked(b, row_b)
    said: dict[tuple[int, int], str] = {}  # asked() shares one Asked per params text: once per combination
    for i in np.flatnonzero(reason == "").tolist():
        x, y = asked_a[i], asked_b[i]
        if (id(x), id(y)) not in said:
            said[id(x), id(y)] = sampled_reason(x, y) or requests_differ(x, y)
        reason[i] = said[id(x), id(y)]
    length = np.where(reason == "", np.minimum(n_a, n_b), 0)
    for rsn in (_unknown_ids_reason(a, b, length, off_a, off_b), _replay_reason(a, b, length, off_a, off_b)):
        fill = (reason == "") & (rsn != "")
        reason[fill] = rsn[fill]
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


def _ambiguous_reason(a: Side, b: Side, keys: np.ndarray, ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
    """A key answered ok more than once in one trace: which is the run's answer? Each
    answer is shown against the other side's (where it first differs)."""
    out = np.full(len(keys), "", dtype=object)
    for label, side, other, orow in (("A", a, b, rb), ("B", b, a, ra)):
        if not side.ambiguous:
            continue
        t = side.table
        for i, k in enumerate(keys.tolist()):
            if k not in side.ambiguous or out[i]:
                continue
            theirs = _tokens(other, int(orow[i]))
            said = []
            for r in np.flatnonzero((t.key == k) & (t.status == "ok")).tolist():
                mine = _tokens(side, r)
                n = min(len(mine), len(theirs))
                d = np.flatnonzero(mine[:n] != theirs[:n])
                at = r if side.request_rows is None else int(side.request_rows[r])  # the file's row
                name = f"row {at}" + (f" (history {t.history[r]})" if t.history[r] else "")
                if len(d):
                    said.append(f"{name} differs at {d[0]} ({mine[d[0]]} vs {theirs[d[0]]})")
                else:
                    said.append(f"{name} {'same tokens' if len(mine) == len(theirs) else 'same prefix'}")
            out[i] = (
                f"{label} ({side.path}) holds {len(said)} ok answers for this key: {'; '.join(said)}; which one "
                "is the run's answer is ambiguous (select one with --a-select/--b-select)"
            )
    return out


def _tokens(side: Side, row: int) -> np.ndarray:
    t = side.table
    return side.token_id[t.token_offset[row] : t.token_offset[row] + t.n_tokens[row]]


def _replay_reason(a: Side, b: Side, length, off_a, off_b) -> np.ndarray:
    """A teacher-forced side predicts each position after the tokens it replayed:
    those must be the other side's tokens (or its replay), else the contexts differ."""
    out = np.full(len(length), "", dtype=object)
    if a.replayed is None and b.replayed is None:
        return out
    seg, pos, _ = segments(length)
    ctx_a = (a.replayed if a.replayed is not None else a.token_id)[off_a[seg] + pos]
    ctx_b = (b.replayed if b.replayed is not None else b.token_id)[off_b[seg] + pos]
    bad = np.flatnonzero(ctx_a != ctx_b)
    segs, first = np.unique(seg[bad], return_index=True)
    for i, j in zip(segs.tolist(), bad[first].tolist()):
        out[i] = (
            f"the teacher-forced side replays other tokens than the other side's "
            f"(position {int(pos[j])}: {int(ctx_a[j])} vs {int(ctx_b[j])}): its predictions saw another prefix"
        )
    return out


def _unknown_ids_reason(a: Side, b: Side, length, off_a, off_b) -> np.ndarray:
    """Token id -1 (unknown: the engine sent token strings and capture had no
    tokenizer) never equals anything: such a pair cannot be compared by ids."""
    out = np.full(len(length), "", dtype=object)
    if not ((a.token_id < 0).any() or (b.token_id < 0).any()):  # no unknown id in either trace
        return out
    seg, pos, _ = segments(length)
    for label, side, off in (("A", a, off_a), ("B", b, off_b)):
        bad = side.token_id[off[seg] + pos] < 0
        cnt = np.bincount(seg[bad], minlength=len(length))
        for i in np.flatnonzero((cnt > 0) & (out == "")).tolist():
            out[i] = (
                f"token ids unknown (-1) at {cnt[i]} of {length[i]} positions of {label}: the engine sent "
                "token strings only and capture had no tokenizer (recapture with --tokenizer DIR)"
            )
    return out
