"""What the writer checks before a request touches the journal or the file.

The rule: the writer refuses whatever the reader could not read back exactly.
A value that does not fit its column (a finish reason over 16 bytes, a count
outside int32), an enumeration outside its set, prompt ids that disagree with
`prompt_len`, token columns wider than the trace's layout or carrying columns
it has no room for: each is a TraceFormatError naming the request and the
field, raised before anything of its group is written. Nothing is truncated,
wrapped or dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import TraceFormatError
from ..schema import Layout, RequestRecord, TokenColumns
from .columns import ENUMS, FIXED, RAGGED

_INT_RANGE = {"<i2": (-1, (1 << 15) - 1), "<i4": (-1, (1 << 31) - 1)}  # -1 = unknown; never below
_INT_FIELDS = ("http_status", "cached_tokens", "prompt_len")
_FLOAT_FIELDS = ("t_sent_s", "t_first_token_s", "t_done_s")
_TEXT_FIXED = ("prompt_hash", "status", "finish_reason", "dtype")


@dataclass(frozen=True)
class Row:
    """One request, checked and encoded: what the writer appends. `check_request` makes it; the
    writer takes one as it is (no second check) when it was checked for the writer's layout."""

    fixed: dict  # request column -> value (offsets filled in by the writer)
    ragged: dict  # ragged column -> UTF-8 bytes
    tokens: TokenColumns  # padded to the layout's top-k width
    prompt_ids: np.ndarray | None  # int32, or None when prompt_len is unknown
    unique: tuple[str, str, str]  # (key, history, dtype): one row each in a trace
    record: RequestRecord  # what was checked (the journal keeps it whole)
    layout: Layout  # the layout it was checked against


def _fail(where: str, rec_key: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: request {rec_key!r:.80}: {what}; the trace cannot hold it (docs/format.md)")


def _fixed_text(name: str, value, where: str, key: str) -> bytes:
    if not isinstance(value, str):
        raise _fail(where, key, f"{name} must be a string, got {type(value).__name__}")
    width = int(FIXED[name][0][1:])
    try:
        data = value.encode("ascii")
    except UnicodeEncodeError:
        raise _fail(where, key, f"{name} {value!r:.40} is not ASCII") from None
    if len(data) > width or b"\0" in data:
        raise _fail(where, key, f"{name} {value!r:.40} is {len(data)} bytes; the column holds at most {width}, no NUL")
    allowed = ENUMS.get(name)
    if allowed is not None and value not in allowed:
        raise _fail(where, key, f"{name} {value!r} is not one of {', '.join(repr(a) for a in allowed)}")
    return data


def _ids(name: str, a, where: str, key: str, lo: int) -> np.ndarray:
    """An id array as int32, refusing values that int32 would wrap or a float would lose."""
    arr = np.asarray(a)
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise _fail(where, key, f"{name} must hold integers, got {arr.dtype}")
    if arr.size and (arr.min() < lo or (arr.dtype != np.int32 and arr.max() > (1 << 31) - 1)):
        raise _fail(where, key, f"{name} holds {arr.min()}..{arr.max()}, outside {lo}..2^31-1")
    return arr.astype(np.int32, copy=False)


def _tokens(toks, layout: Layout, where: str, key: str) -> TokenColumns:
    if toks is None:
        return TokenColumns.empty(layout.topk, layout.raw_logits, layout.vocab_size)
    if not isinstance(toks, TokenColumns):
        raise _fail(where, key, f"tokens must be TokenColumns or None, got {type(toks).__name__}")
    if toks.k > layout.topk:
        raise _fail(where, key, f"top-k width {toks.k} exceeds the trace's width {layout.topk}")
    if toks.topk_logit is not None and not layout.raw_logits:
        raise _fail(where, key, "raw top-k logits given, but the trace was created without raw_logits")
    if toks.logits is not None and toks.logits.shape[1] != layout.vocab_size:
        raise _fail(where, key, f"full logits of width {toks.logits.shape[1]}, the trace stores {layout.vocab_size}")
    if layout.vocab_size and len(toks) and toks.logits is None:
        raise _fail(where, key, f"this trace stores full logits of width {layout.vocab_size}; none given")
    _ids("token_id", toks.token_id, where, key, -1)  # -1 = unknown id (a strings-only engine)
    _ids("topk_id", toks.topk_id, where, key, -1)  # -1 pads rows with fewer candidates
    return toks.padded_to(layout.topk)


def _prompt(rec: RequestRecord, prompt_ids, where: str, key: str) -> tuple[int, np.ndarray | None]:
    if prompt_ids is None:
        if rec.prompt_len != -1:
            raise _fail(where, key, f"prompt_len={rec.prompt_len} but no prompt ids (give them, or prompt_len=-1)")
        return -1, None
    pids = _ids("prompt ids", prompt_ids, where, key, -(1 << 31))
    if pids.ndim != 1:
        raise _fail(where, key, f"prompt ids must be 1-D, got shape {pids.shape}")
    if rec.prompt_len not in (-1, len(pids)):
        raise _fail(where, key, f"prompt_len={rec.prompt_len} but {len(pids)} prompt ids")
    return len(pids), pids


def check_request(rec: RequestRecord, tokens, prompt_ids, layout: Layout, where: str = "trace") -> Row:
    """Check one request against the format and the trace's layout; encode it as a `Row`.

    Public so that a capture can test an engine's answer before it reaches the
    writer (and record it as an error row instead of stopping the run), then hand the
    writer this Row, which it does not check again."""
    if not isinstance(rec, RequestRecord):
        raise TraceFormatError(f"{where}: expected a RequestRecord, got {type(rec).__name__}")
    key = rec.key
    fixed = {name: _fixed_text(name, getattr(rec, name), where, key) for name in _TEXT_FIXED}
    for name in _INT_FIELDS:
        v = getattr(rec, name)
        lo, hi = _INT_RANGE[FIXED[name][0]]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not lo <= v <= hi:
            raise _fail(where, key, f"{name}={v!r:.40} is not an integer in {lo}..{hi}")
        fixed[name] = int(v)
    for name in _FLOAT_FIELDS:
        v = getattr(rec, name)
        if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool) or math.isinf(v):
            raise _fail(where, key, f"{name}={v!r:.40} is not a finite number of seconds (NaN = unknown)")
        fixed[name] = float(v)
    ragged = {}
    for name in RAGGED:
        v = getattr(rec, name)
        if not isinstance(v, str):
            raise _fail(where, key, f"{name} must be a string, got {type(v).__name__}")
        try:
            ragged[name] = v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _fail(where, key, f"{name} is not valid Unicode ({e.reason} at {e.start})") from None
    if not key:
        raise _fail(where, key, "the key is empty")
    toks = _tokens(tokens, layout, where, key)
    fixed["prompt_len"], pids = _prompt(rec, prompt_ids, where, key)
    fixed["n_tokens"] = len(toks)
    return Row(fixed, ragged, toks, pids, (key, rec.history, rec.dtype), rec, layout)
