"""What every dialect shares: the request spec, the per-request accumulator and
the Protocol a dialect implements.

A dialect turns one engine's JSON into appends on an `Acc` (plain Python lists,
one append per token); `Acc.columns()` builds the numpy `TokenColumns` once per
request at the end. Nothing here does I/O: the client owns the socket, the run
loop owns the trace writer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Protocol

import numpy as np

from tracekit.schema import TokenColumns


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt` is text or token ids; `extra` holds
    per-request parameters from the prompt file, merged into the body last."""

    key: str
    prompt: str | list[int]
    max_tokens: int
    top_logprobs: int
    ignore_eos: bool
    stream: bool
    model: str = ""
    temperature: float = 0.0
    extra: dict = field(default_factory=dict)


class Acc:
    """Per-request accumulator. Token columns grow one entry per token:
    ids [n] (-1 when the engine gave only a string), logprobs [n], t [n] (s),
    top_ids / top_lps / top_logits: one list of length <= k per token."""

    __slots__ = (
        "ids",
        "lps",
        "t",
        "top_ids",
        "top_lps",
        "top_logits",
        "strs",
        "top_strs",
        "top_maps",
        "tok_strs",
        "top_keys",
        "top_vals",
        "top_w",
        "finish_reason",
        "cached_tokens",
        "prompt_len",
        "prompt_ids",
        "done",
        "n_events",
        "seen",
    )

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.t: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_lps: list[list[float]] = []
        self.top_logits: list[list[float]] | None = None
        self.strs: list[str] | None = None  # chosen token strings, when ids are unknown
        self.top_strs: list[list[str]] | None = None
        # Legacy completions layout (OpenAI / vLLM): the raw `{token string: logprob}` dicts and
        # chosen token strings are kept as they come and converted in bulk by columns(): the
        # per-token work in the hot path is a few list appends.
        self.top_maps: list[dict] | None = None
        self.tok_strs: list[str] | None = None
        # The compact form of the same (used while no key holds a space, e.g. vLLM's
        # "token_id:N"): per token its keys joined by " " and its width; all values in one
        # flat list. Keeping the parsed dicts alive costs ~3 KB of Python objects a token at
        # k=20 (allocation and cache misses: ~1.3 us a token); this keeps ~1 KB.
        self.top_keys: list[str] | None = None
        self.top_vals: list[float] | None = None
        self.top_w: list[int] | None = None
        self.finish_reason = ""
        self.cached_tokens = -1  # -1: not reported (never 0 for "absent")
        self.prompt_len = -1
        self.prompt_ids: list[int] | None = None
        self.done = False  # the dialect saw its end-of-stream marker
        self.n_events = 0
        self.seen = 0  # tokens consumed, for cumulative streams (SGLang)

    def add_token(self, tok_id: int, logprob: float, tops, t: float) -> None:
        """One token whose top candidates are dicts with "id" and "logprob" (llama.cpp, TGI)."""
        self.ids.append(tok_id)
        self.lps.append(logprob)
        self.top_ids.append([d["id"] for d in tops])
        self.top_lps.append([d["logprob"] for d in tops])
        self.t.append(t)

    def add_bare_ids(self, ids: list, t: float) -> None:
        """Tokens known by id only (no logprobs asked): NaN logprob, empty top-k."""
        self.ids.extend(ids)
        self.lps.extend([float("nan")] * len(ids))
        self.top_ids.extend([] for _ in ids)
        self.top_lps.extend([] for _ in ids)
        self.t.extend([t] * len(ids))

    def columns(self, k: int, raw_logits: bool, to_ids: Callable[[list[str]], list[int]] | None) -> TokenColumns:
        """Build the numpy columns once: [n], [n, k]; pads short top-k rows with -1 / NaN."""
        n = len(self.lps)
        if self.tok_strs is not None:
            return self._legacy_columns(k, raw_logits, to_ids)
        ids, top_ids_rows = self.ids, self.top_ids
        if self.strs is not None and to_ids is not None:
            # Map only what the engine left unknown (-1); ids it gave win.
            ids = [i if i >= 0 else m for i, m in zip(ids, to_ids(self.strs))]
            top_ids_rows = [
                row if (not row or row[0] >= 0) else to_ids(s) for row, s in zip(self.top_ids, self.top_strs)
            ]
        tid = np.full((n, k), -1, np.int32)
        tlp = np.full((n, k), np.nan, np.float32)
        tlg = np.full((n, k), np.nan, np.float32) if raw_logits else None
        if n and k:
            widths = {len(r) for r in self.top_lps}
            if len(widths) == 1 and widths.pop() >= k:
                # The common case: every row has k entries; one vectorised copy.
                tid[:] = np.asarray(top_ids_rows, np.int32)[:, :k]
                tlp[:] = np.asarray(self.top_lps, np.float32)[:, :k]
                if tlg is not None and self.top_logits is not None:
                    tlg[:] = np.asarray(self.top_logits, np.float32)[:, :k]
            else:
                for i in range(n):
                    m = min(len(self.top_lps[i]), k)
                    tid[i, :m] = top_ids_rows[i][:m]
                    tlp[i, :m] = self.top_lps[i][:m]
                    if tlg is not None and self.top_logits is not None and self.top_logits[i]:
                        tlg[i, :m] = self.top_logits[i][:m]
        return TokenColumns(
            np.asarray(ids, np.int32).reshape(n),
            np.asarray(self.lps, np.float32),
            np.asarray(self.t, np.float64),
            tid,
            tlp,
            tlg,
        )

    def start_legacy(self) -> None:
        """First legacy-layout token of the request: accumulate in the compact form."""
        if self.lps:  # a chat-style request switching layout: not seen in the wild
            raise EngineErrorEvent("logprobs switched between the chat-style and legacy layouts mid-stream")
        self.tok_strs, self.top_keys, self.top_vals, self.top_w = [], [], [], []

    def add_tops(self, tops: list[dict]) -> None:
        """Legacy `top_logprobs` dicts, one per token, in the compact form while it is exact."""
        keys, vals, widths = self.top_keys, self.top_vals, self.top_w
        if keys is None:
            self.top_maps.extend(tops)
            return
        for i, d in enumerate(tops):
            s = " ".join(d)
            w = len(d)
            if w and s.count(" ") >= w:  # a key holds a space: the join would not split back
                self._to_maps()
                self.top_maps.extend(tops[i:])
                return
            keys.append(s)
            vals.extend(d.values())
            widths.append(w)

    def _to_maps(self) -> None:
        maps, off = [], 0
        for s, w in zip(self.top_keys, self.top_w):
            maps.append(dict(zip(s.split(" ") if w else (), self.top_vals[off : off + w])))
            off += w
        self.top_maps, self.top_keys, self.top_vals, self.top_w = maps, None, None, None

    def _legacy_tops(self, to_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """widths [n], flat top ids [sum w], flat values [sum w] of the legacy layout."""
        if self.top_keys is None:
            maps = self.top_maps
            widths = np.fromiter(map(len, maps), np.int64, len(maps))
            keys = list(chain.from_iterable(maps))
            vals = np.fromiter(chain.from_iterable(map(dict.values, maps)), np.float64, len(keys))
            return widths, vals, _ids_of(keys, to_ids)
        widths = np.asarray(self.top_w, np.int64)
        total = len(self.top_vals)
        vals = np.fromiter(self.top_vals, np.float64, total)
        ids = _token_id_ints(" ".join(self.top_keys), total)
        if ids is None:  # not all vLLM ids: split back and map them
            ids = _split_keys(self.top_keys, self.top_w, to_ids)
        return widths, vals, ids

    def _legacy_columns(self, k: int, raw_logits: bool, to_ids) -> TokenColumns:
        """Vectorised conversion of the legacy tops: [n] rows of width w_i -> [n, k]."""
        n = len(self.lps)
        rows = len(self.top_w) if self.top_keys is not None else len(self.top_maps)
        if rows != n:
            raise ValueError(f"{n} tokens but top-k rows for {rows}")
        widths, vals, flat = self._legacy_tops(to_ids)
        if len(self.ids) == n:
            chosen = np.asarray(self.ids, np.int64)
        else:
            chosen = _ids_of(self.tok_strs, to_ids)
        top = (
            np.asarray(self.top_ids, np.int64)
            if len(self.top_ids) == n and n and all(len(r) == w for r, w in zip(self.top_ids, widths.tolist()))
            else None
        )
        flat_ids = top.reshape(-1) if top is not None else flat
        tid = np.full((n, k), -1, np.int32)
        tlp = np.full((n, k), np.nan, np.float32)
        w = int(widths[0]) if n else 0
        if n and len(vals) == n * w and (widths == w).all():
            # The common case: every token has the same top-k width; a reshape, no scatter.
            m = min(w, k)
            tid[:, :m] = flat_ids.reshape(n, w)[:, :m]
            tlp[:, :m] = vals.reshape(n, w)[:, :m]
        else:
            # Scatter the flat entries into [n, k]: row r, column j < k.
            rows = np.repeat(np.arange(n), widths)
            cols = np.arange(len(vals)) - np.repeat(np.cumsum(widths) - widths, widths)
            keep = cols < k
            tid[rows[keep], cols[keep]] = flat_ids[keep]
            tlp[rows[keep], cols[keep]] = vals[keep]
        tlg = None
        if raw_logits:
            tlg = np.full((n, k), np.nan, np.float32)
            lg = self.top_logits
            if lg is not None and len(lg) == n and all(len(r) == k for r in lg):
                tlg[:] = np.asarray(lg, np.float32).reshape(n, k)
            elif lg is not None:
                for i, row in enumerate(lg[:n]):
                    m = min(len(row), k)
                    tlg[i, :m] = row[:m]
        return TokenColumns(
            chosen.astype(np.int32), np.asarray(self.lps, np.float32), np.asarray(self.t, np.float64), tid, tlp, tlg
        )


_TID = "token_id:"


def _split_keys(joined: list[str], widths: list[int], to_ids) -> np.ndarray:
    """Rows of " "-joined keys back into ids. A row that does not split back into its width
    (a key holding a space, which the inlined path in openai.py admits when the row's first
    key is a "token_id:" one) gets -1 ids: unknown, never wrong."""
    keys, bad, off = [], [], 0
    for s, w in zip(joined, widths):
        row = s.split(" ") if w else []
        if len(row) != w:
            row = [""] * w
            bad.extend(range(off, off + w))
        keys += row
        off += w
    ids = _ids_of(keys, to_ids)
    ids[bad] = -1
    return ids


def _token_id_ints(joined: str, n: int) -> np.ndarray | None:
    """ "token_id:N token_id:M ..." (n of them) -> int64 [n], or None when it is not that."""
    if not n or joined[:9] != _TID or joined.count(":") != n:  # ":" counts faster than _TID
        return None
    # C-speed parse with the prefix as numpy's separator (about 0.4 us per token at k=20,
    # vs 2-5 us for int() per string). Malformed input stops the parse early (a short
    # result; a ValueError in later numpy).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            out = np.fromstring(joined[9:], dtype=np.int64, sep=" " + _TID)
        except ValueError:
            return None
    return out if len(out) == n else None


def _ids_of(strs: list, to_ids) -> np.ndarray:
    """Token strings -> ids: vLLM's "token_id:N" in bulk, else the tokenizer, else -1."""
    if not strs:
        return np.zeros(0, np.int64)
    out = _token_id_ints(" ".join(strs), len(strs))
    if out is not None:
        return out
    if to_ids is not None:
        return np.asarray(to_ids(strs), np.int64)
    return np.full(len(strs), -1, np.int64)


class EngineErrorEvent(Exception):
    """An error object inside a 200 stream or body (the message is the excerpt)."""


class Dialect(Protocol):
    """One engine's wire format. Implementations are small modules; see
    capture/dialects/__init__.py for the table."""

    name: str
    done_marker: bool  # the stream ends with `data: [DONE]` (a stream without it is cut)

    def route(self, stream: bool) -> str: ...

    def body(self, spec: RequestSpec) -> dict[str, Any]: ...

    bad_status: int  # the HTTP status the engine answers bad_body with (400; TGI 422)

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        """spec's body with its token-limit field set to a non-numeric string: a wrong-typed
        field that every engine of the dialect validates before generating anything (the
        runner's `bad_request` check). A negative limit is not: llama.cpp takes -1 as "no
        limit", SGLang's and TGI's routes do not read `max_tokens` at all."""

    def parse_response(self, obj: dict, acc: Acc, t: float) -> None:
        """A whole non-stream body; every token gets arrival time t."""

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        """One stream event; sets acc.done when it is the dialect's last event."""


BAD_VALUE = "many"  # a token limit no engine parses as an integer


def check_error(obj: Any) -> None:
    """Raise EngineErrorEvent for an `{"error": ...}` object (OpenAI, vLLM, TGI, llama.cpp)."""
    if type(obj) is dict and "error" in obj and obj["error"]:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise EngineErrorEvent(str(msg)[:500])
    if type(obj) is not dict:
        raise EngineErrorEvent(f"expected a JSON object, got {type(obj).__name__}")


def usage_into(usage: Any, acc: Acc) -> None:
    """OpenAI `usage`: prompt_tokens and prompt_tokens_details.cached_tokens
    (absent means unknown: leave -1, never write 0)."""
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        acc.prompt_len = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        acc.cached_tokens = details["cached_tokens"]
