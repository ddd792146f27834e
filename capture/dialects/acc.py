"""The per-request accumulator every dialect appends to, and its one conversion to columns.

One compact form for every engine: per token its chosen id, logprob, arrival time and
top-k width; the top-k candidates of all tokens in flat lists (ids, values, and raw
logits where the engine sends them). An id the engine sent as a string (vLLM's
"token_id:N", a strings-only engine's token text or bytes) is kept as that string and
resolved once per request in `columns()`: vLLM's form in bulk at C speed, other strings
through the tokenizer, else -1 (unknown, never a guess). The per-token work in the hot
path is a few list appends; nothing parsed is kept alive (a top-20 dict kept per token
cost ~1.3 us a token in allocation and cache misses).

`columns()` also puts each token's candidates in rank order (descending value, stable):
vLLM lists the sampled token first, and the trace promises rank order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tracekit.errors import ResponseShapeError
from tracekit.schema import TokenColumns

ToIds = Callable[[list], list[int]]
TOKEN_ID = "token_id:"  # vLLM's return_tokens_as_token_ids form
_DIGITS = b"0123456789"


class Acc:
    """Per-request accumulator.

    ids [n]: int, or the token's string / bytes when the engine sent no id (str_ids set);
    lps [n] logprob (None/NaN unknown); t [n] arrival (s); widths [n] top-k entries a token;
    top_ids / top_vals [sum widths]: the candidates, flat (str_tops set when an id is a
    string); top_logits [sum widths] raw logits aligned with them, or None (NaN where a
    token had none)."""

    __slots__ = (
        "ids",
        "lps",
        "t",
        "widths",
        "top_ids",
        "top_vals",
        "top_logits",
        "str_ids",
        "str_tops",
        "finish_reason",
        "cached_tokens",
        "prompt_ids",
        "done",
        "seen",
    )

    def __init__(self) -> None:
        self.ids: list = []
        self.lps: list = []
        self.t: list[float] = []
        self.widths: list[int] = []
        self.top_ids: list = []
        self.top_vals: list = []
        self.top_logits: list | None = None
        self.str_ids = False
        self.str_tops = False
        self.finish_reason = ""
        self.cached_tokens = -1  # -1: not reported (never 0 for "absent")
        self.prompt_ids: list[int] | None = None
        self.done = False  # the dialect saw its end-of-stream marker
        self.seen = 0  # tokens consumed, for cumulative streams (SGLang)

    def add_token(self, tok_id, logprob, tops, t: float) -> None:
        """One token whose top candidates are dicts with "id" and "logprob" (llama.cpp, TGI)."""
        try:
            ids = [d["id"] for d in tops]
            vals = [d["logprob"] for d in tops]
        except (KeyError, TypeError) as e:
            raise ResponseShapeError(f"a top candidate without 'id' and 'logprob' ({e!r})") from None
        self.add(tok_id, logprob, ids, vals, t)

    def add(self, tok_id: int, logprob, ids: list, vals: list, t: float) -> None:
        """One token with its candidates' ids and values (same length)."""
        if type(tok_id) is not int:
            raise ResponseShapeError(f"token id {tok_id!r} is not an integer")
        self.ids.append(tok_id)
        self.lps.append(logprob)
        self.t.append(t)
        self.widths.append(len(ids))
        self.top_ids += ids
        self.top_vals += vals

    def add_bare_ids(self, ids: list, t: float) -> None:
        """Tokens known by id only (no logprobs asked): NaN logprob, no candidates."""
        if type(ids) is not list or not all(type(i) is int for i in ids):
            raise ResponseShapeError(f"token ids {str(ids)[:80]} are not a list of integers")
        n = len(ids)
        self.ids += ids
        self.lps += [None] * n
        self.t += [t] * n
        self.widths += [0] * n

    def pad_logits(self, start: int) -> None:
        """No raw logits for the candidates appended since flat index `start`: NaN."""
        if self.top_logits is None:
            self.top_logits = [None] * start
        self.top_logits += [None] * (len(self.top_vals) - start)

    def token_ids(self, to_ids: ToIds | None = None) -> list[int]:
        """The chosen ids so far as ints (-1 where a string maps to nothing)."""
        return resolve_ids(self.ids, self.str_ids, to_ids).tolist()

    def columns(self, k: int, raw_logits: bool, to_ids: ToIds | None) -> TokenColumns:
        """Build the numpy columns once: [n] and [n, k] in rank order, padded with -1 / NaN."""
        n = len(self.lps)
        total = len(self.top_vals)
        if not len(self.ids) == len(self.t) == len(self.widths) == n:
            raise ValueError(f"{n} logprobs, {len(self.ids)} ids, {len(self.widths)} top-k rows")
        if len(self.top_ids) != total or sum(self.widths) != total:
            raise ValueError(f"{len(self.top_ids)} top-k ids, {total} values, widths sum {sum(self.widths)}")
        chosen = resolve_ids(self.ids, self.str_ids, to_ids)
        flat = resolve_ids(self.top_ids, self.str_tops, to_ids)
        try:
            vals = np.fromiter(self.top_vals, np.float64, total)
        except TypeError:  # a null value (unknown): NaN
            vals = np.array(self.top_vals, np.float64)
        logits = None
        if raw_logits and self.top_logits is not None:
            if len(self.top_logits) != total:
                raise ValueError(f"{len(self.top_logits)} top-k logits for {total} candidates")
            logits = np.array(self.top_logits, np.float64)
        tid, tlp, tlg = rank_matrix(np.asarray(self.widths, np.int64), flat, vals, logits, k, chosen)
        return TokenColumns(
            chosen.astype(np.int32),
            np.array(self.lps, np.float32),
            np.array(self.t, np.float64),
            tid,
            tlp,
            (tlg if tlg is not None else np.full((n, k), np.nan, np.float32)) if raw_logits else None,
        )


def rank_matrix(widths: np.ndarray, ids: np.ndarray, vals: np.ndarray, logits: np.ndarray | None, k: int, chosen=None):
    """Flat candidates (row i has widths[i] of them) -> ids, values, logits [n, k], padded -1 / NaN.

    Rows are stored in the engine's own order: the order is part of what the engine reports, and
    `tracekit diff` checks it (analyze/reported.py: a misordered row is a misreport, never
    silently repaired). A row is ranked (descending value, stable: ties keep the engine's order)
    only where that is what the engine meant: it holds more than k candidates (its top k are
    kept), or it lists the chosen token first (vLLM puts a sampled token ahead of its top-k).
    A greedy engine's chosen token is its top-1, so its rows are never reordered here."""
    n, total = len(widths), len(vals)
    if n and k and total == n * k and (widths == k).all():
        got = _rank_full(ids, vals, logits, n, k, chosen)
        if got is not None:
            return got
    tid = np.full((n, k), -1, np.int32)
    tlp = np.full((n, k), np.nan, np.float32)
    tlg = None if logits is None else np.full((n, k), np.nan, np.float32)
    if not n or not total or not k:
        return tid, tlp, tlg
    rows = np.repeat(np.arange(n), widths)
    start = np.cumsum(widths) - widths
    cols = np.arange(total) - start[rows]
    need = _rank_rows(widths, ids, vals, rows, start, chosen, k)
    if need.any():
        key = np.where(need[rows], -vals, cols.astype(np.float64))  # a NaN value sorts last
        order = np.lexsort((key, rows))  # by row, then (ranked rows) descending value; stable
    else:
        order = np.arange(total)
    keep = cols < k
    r, c, o = rows[keep], cols[keep], order[keep]
    tid[r, c], tlp[r, c] = ids[o], vals[o]
    if tlg is not None:
        tlg[r, c] = logits[o]
    return tid, tlp, tlg


def _rank_full(ids, vals, logits, n: int, k: int, chosen):
    """The common case of rank_matrix: every row exactly k wide. Reshaped as they are when no row
    needs ranking (None otherwise: the general path ranks it), a third of the general path's
    cost (no row/column bookkeeping, no sort)."""
    v = vals.reshape(n, k)
    if chosen is not None and k > 1:
        bad = (v[:, 1:] > v[:, :-1]).any(axis=1)  # a NaN compares False: as the general path
        if bad.any() and (ids.reshape(n, k)[bad, 0] == np.asarray(chosen)[bad]).any():
            return None
    tid = ids.reshape(n, k).astype(np.int32)
    tlg = None if logits is None else logits.reshape(n, k).astype(np.float32)
    return tid, v.astype(np.float32), tlg


def _rank_rows(widths, ids, vals, rows, start, chosen, k) -> np.ndarray:
    """[n] rows to rank: wider than k, or out of order with the chosen token listed first."""
    need = widths > k
    out_of_order = np.r_[rows[1:] == rows[:-1], False] & (np.r_[vals[1:], np.nan] > vals)
    bad = np.bincount(rows[out_of_order], minlength=len(widths)) > 0
    if chosen is not None and bad.any():
        has = widths > 0
        lead = np.zeros(len(widths), bool)
        lead[has] = ids[start[has]] == np.asarray(chosen)[has]
        need |= bad & lead
    return need


def resolve_ids(items: list, has_strs: bool, to_ids: ToIds | None) -> np.ndarray:
    """ids and token strings -> int64 ids: ints as they are, vLLM's "token_id:N" parsed, other
    strings (or bytes) through the tokenizer, else -1."""
    if not has_strs or not items:
        return np.array(items, np.int64).reshape(len(items))
    try:
        joined = " ".join(items)  # every item a str (the vLLM case): one bulk parse
    except TypeError:
        return _resolve_mixed(items, to_ids)
    out = token_id_ints(joined, len(items))
    if out is not None:
        return out
    return _resolve_mixed(items, to_ids)


def _resolve_mixed(items: list, to_ids: ToIds | None) -> np.ndarray:
    out = np.full(len(items), -1, np.int64)
    strs, where = [], []
    for j, x in enumerate(items):
        if type(x) is int:
            out[j] = x
        elif type(x) is str and x.startswith(TOKEN_ID) and x[9:].isdigit() and x[9:].isascii():
            out[j] = int(x[9:])
        elif isinstance(x, (str, bytes)):
            strs.append(x)
            where.append(j)
        elif x is not None:
            raise ResponseShapeError(f"token id {x!r} is neither an integer nor a token string")
    if strs and to_ids is not None:
        out[where] = to_ids(strs)
    return out


def token_id_ints(joined: str, n: int) -> np.ndarray | None:
    """ "token_id:N token_id:M ..." (n of them) -> int64 [n], or None when it is not exactly that."""
    # Checked before parsing, so the parse below never meets malformed text: without the digits
    # it must read "token_id: token_id: ..." (a C-speed translate; ~0.2 us a token at k=20).
    try:
        raw = joined.encode("ascii")
    except UnicodeEncodeError:
        return None
    if raw.translate(None, _DIGITS) != (b"token_id: " * n)[:-1]:
        return None
    # numpy's text parse with the prefix as separator (~0.4 us a token at k=20, vs 2-5 us for int()
    # per string); an empty number ("token_id: ") or an id past int32 fails the checks after it.
    try:
        out = np.fromstring(joined[9:], dtype=np.int64, sep=" " + TOKEN_ID)
    except ValueError:
        return None
    if len(out) != n or (n and (out.min() < 0 or out.max() > np.iinfo(np.int32).max)):
        return None
    return out
