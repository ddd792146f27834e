"""The trace format's records: run metadata, request rows and token columns.

This module holds plain data only (frozen dataclasses, numpy inside). Reading
and writing HDF5 lives in `tracekit.store`; nothing here touches h5py.
Unknown values are None in Python, -1 in stored int columns, NaN in float
columns and "" in string columns (documented in docs/format.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from .runrecord import RunRecord

FORMAT = "tracekit.trace"
FORMAT_VERSION = 1
SOURCES = ("http", "teacher_forced")
STATUSES = ("ok", "error", "cancelled", "timeout")

# Keys that must never reach a trace, a log or a report (matched case-insensitively
# as substrings of a mapping key).
SECRET_KEY_PARTS = ("api_key", "apikey", "authorization", "auth_header", "token_secret", "password", "bearer")


def redact(obj: Any) -> Any:
    """Drop secret-looking keys from nested JSON-able data (values never copied)."""
    if isinstance(obj, Mapping):
        return {k: redact(v) for k, v in obj.items() if not any(p in str(k).lower() for p in SECRET_KEY_PARTS)}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


def prompt_hash(prompt: str | list[int] | np.ndarray) -> str:
    """sha256 hex of a prompt: of its UTF-8 text, or of its int32 token ids."""
    if isinstance(prompt, str):
        data = b"t:" + prompt.encode("utf-8")
    else:
        data = b"i:" + np.asarray(prompt, dtype="<i4").tobytes()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Layout:
    """Widths fixed when a trace is created (SWMR forbids adding datasets later).

    topk: width of the top-k columns (rows with fewer candidates are padded
    with id -1 and logprob NaN). raw_logits: the `topk_logit` column exists.
    vocab_size: > 0 when the full-vocabulary `logits` column [N, V] exists.
    """

    topk: int
    raw_logits: bool = False
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.topk < 0 or self.vocab_size < 0:
            raise ValueError(f"Layout widths must be >= 0, got topk={self.topk} vocab_size={self.vocab_size}")


@dataclass(frozen=True)
class RunMeta:
    """Root attributes of a trace. `run` is JSON: everything needed to reproduce it; read it
    through `record` (tracekit/runrecord.py), never by key paths."""

    source: str
    run: Mapping[str, Any]
    layout: Layout
    format_version: int = FORMAT_VERSION
    writer: str = ""
    created_utc: str = ""
    checksum: str = ""  # "fletcher32": every dataset's chunks carry a checksum; "" an older file without

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        # Canonicalise and redact once, so no code path can store a secret.
        object.__setattr__(self, "run", json.loads(json.dumps(redact(dict(self.run)), default=str)))

    @cached_property
    def record(self) -> RunRecord:
        """`run` as the typed, versioned run record (validated and upgraded once)."""
        return RunRecord.from_json(self.run)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.record.eos_token_ids


@dataclass(frozen=True)
class RequestRecord:
    """One request row. Times are seconds on the run's monotonic clock (t=0 at run start)."""

    key: str
    prompt_hash: str
    status: str = "ok"
    http_status: int = -1
    error: str = ""
    finish_reason: str = ""
    cached_tokens: int = -1  # reused-prefix boundary in tokens; -1 = not reported
    prompt_len: int = -1  # -1 = unknown (text prompt, engine did not return ids)
    t_sent_s: float = math.nan
    t_first_token_s: float = math.nan
    t_done_s: float = math.nan
    history: str = ""  # teacher-forced only: full | prefix:B | chunked:C | decode
    dtype: str = ""  # teacher-forced only: fp32 | bf16 | fp16
    params: str = ""  # JSON of the request's sampling parameters
    prompt_text: str = ""  # the prompt text when it was sent as text
    output_len: int = -1  # filled by the reader from the token offsets

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if not self.key:
            raise ValueError("a request row needs a non-empty key")

    @property
    def ttft_s(self) -> float:
        return self.t_first_token_s - self.t_sent_s

    @property
    def e2e_s(self) -> float:
        return self.t_done_s - self.t_sent_s


@dataclass(frozen=True)
class TokenColumns:
    """Per-position columns of one request (or of many, concatenated).

    token_id [N] int32 · logprob [N] float32 (natural log; NaN = unknown) ·
    t_arrival_s [N] float64 · topk_id [N, k] int32 (-1 pad) ·
    topk_logprob [N, k] float32 (NaN pad) · topk_logit [N, k] float32 or None ·
    logits [N, V] float32 or None.
    """

    token_id: np.ndarray
    logprob: np.ndarray
    t_arrival_s: np.ndarray
    topk_id: np.ndarray
    topk_logprob: np.ndarray
    topk_logit: np.ndarray | None = None
    logits: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.token_id)

        def set_(name, dt):
            a = np.asarray(getattr(self, name))
            if dt is np.int32 and a.dtype != np.int32 and a.size:
                # numpy casts out-of-range ints by wrapping and floats by truncating: refuse both
                if a.dtype.kind not in "iub" and not np.array_equal(a, np.round(a)):
                    raise ValueError(f"{name}: token ids must be integers, got {a.dtype}")
                if a.min() < -(1 << 31) or a.max() > (1 << 31) - 1:
                    raise ValueError(f"{name}: ids {a.min()}..{a.max()} do not fit int32")
            return object.__setattr__(self, name, a.astype(dt, copy=False))

        for name, dt in (
            ("token_id", np.int32),
            ("logprob", np.float32),
            ("t_arrival_s", np.float64),
            ("topk_id", np.int32),
            ("topk_logprob", np.float32),
        ):
            set_(name, dt)
        for name in ("topk_logit", "logits"):
            if getattr(self, name) is not None:
                set_(name, np.float32)
        for name in ("logprob", "t_arrival_s"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {getattr(self, name).shape}")
        if self.topk_id.ndim != 2 or self.topk_id.shape[0] != n or self.topk_logprob.shape != self.topk_id.shape:
            raise ValueError(
                f"topk_id/topk_logprob: expected [{n}, k], got {self.topk_id.shape} / {self.topk_logprob.shape}"
            )
        if self.topk_logit is not None and self.topk_logit.shape != self.topk_id.shape:
            raise ValueError(f"topk_logit: expected {self.topk_id.shape}, got {self.topk_logit.shape}")
        if self.logits is not None and (self.logits.ndim != 2 or self.logits.shape[0] != n):
            raise ValueError(f"logits: expected [{n}, V], got {self.logits.shape}")

    def __len__(self) -> int:
        return len(self.token_id)

    @property
    def k(self) -> int:
        return self.topk_id.shape[1]

    @classmethod
    def empty(cls, k: int, raw_logits: bool = False, vocab_size: int = 0) -> "TokenColumns":
        return cls(
            np.zeros(0, np.int32),
            np.zeros(0, np.float32),
            np.zeros(0, np.float64),
            np.zeros((0, k), np.int32),
            np.zeros((0, k), np.float32),
            np.zeros((0, k), np.float32) if raw_logits else None,
            np.zeros((0, vocab_size), np.float32) if vocab_size else None,
        )

    def padded_to(self, k: int) -> "TokenColumns":
        """The same columns with top-k widened to k (id -1, logprob/logit NaN)."""
        have = self.k
        if have == k:
            return self
        if have > k:
            raise ValueError(f"top-k width {have} exceeds the trace's width {k}")
        n = len(self)

        def pad(a, v):
            return np.concatenate([a, np.full((n, k - have), v, a.dtype)], axis=1)

        return TokenColumns(
            self.token_id,
            self.logprob,
            self.t_arrival_s,
            pad(self.topk_id, -1),
            pad(self.topk_logprob, np.nan),
            None if self.topk_logit is None else pad(self.topk_logit, np.nan),
            self.logits,
        )


@dataclass(frozen=True)
class RequestTable:
    """All request rows as numpy columns (the small table; read eagerly)."""

    key: np.ndarray  # object (str)
    prompt_hash: np.ndarray  # object (str)
    status: np.ndarray  # object (str)
    http_status: np.ndarray  # int16
    error: np.ndarray  # object (str)
    finish_reason: np.ndarray  # object (str)
    cached_tokens: np.ndarray  # int32, -1 unknown
    prompt_len: np.ndarray  # int32, -1 unknown
    t_sent_s: np.ndarray  # float64
    t_first_token_s: np.ndarray
    t_done_s: np.ndarray
    history: np.ndarray  # object (str)
    dtype: np.ndarray  # object (str)
    params: np.ndarray  # object (str, JSON)
    prompt_text: np.ndarray  # object (str)
    token_offset: np.ndarray  # int64: first row of this request in /tokens
    n_tokens: np.ndarray  # int32: rows in /tokens (= output length)
    prompt_offset: np.ndarray  # int64: first row in /prompt/token_id

    def __len__(self) -> int:
        return len(self.key)

    def record(self, i: int) -> RequestRecord:
        return RequestRecord(
            key=self.key[i],
            prompt_hash=self.prompt_hash[i],
            status=self.status[i],
            http_status=int(self.http_status[i]),
            error=self.error[i],
            finish_reason=self.finish_reason[i],
            cached_tokens=int(self.cached_tokens[i]),
            prompt_len=int(self.prompt_len[i]),
            t_sent_s=float(self.t_sent_s[i]),
            t_first_token_s=float(self.t_first_token_s[i]),
            t_done_s=float(self.t_done_s[i]),
            history=self.history[i],
            dtype=self.dtype[i],
            params=self.params[i],
            prompt_text=self.prompt_text[i],
            output_len=int(self.n_tokens[i]),
        )

    def index_by_key(self) -> dict[str, int]:
        """key -> row. Keys are unique in an HTTP trace (the writer refuses a repeated
        (key, history, dtype); --resume rewrites the file). In a teacher-forced trace a key
        has one row per (history, dtype): there the last row of each key wins."""
        return {k: i for i, k in enumerate(self.key)}

    def counts_by_status(self) -> dict[str, int]:
        return {s: int(np.sum(self.status == s)) for s in STATUSES}
