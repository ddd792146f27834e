"""Cache histories: how a sequence's forward passes are split over a KV cache.

A history is a list of segment ends over the model's inputs. For a sequence of
P prompt tokens and G generated tokens the inputs are tokens[:P+G-1] (the last
generated token is never fed), and the scored positions are P-1 .. P+G-2 (the
logits there predict the G generated tokens).

    full        one forward over all inputs, no cache reuse      ends (n,)
    prefix:B    forward tokens[:B], then the rest on that cache  ends (B, n)
    prefix:auto prefix:B with B = the HTTP trace's cached_tokens
    chunked:C   forwards of C tokens each, each on the cache     ends (C, 2C, ..., n)
    decode      prefill the prompt, then one token a step         ends (P, P+1, ..., n)

This module is pure bookkeeping: it never runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracekit import dtypes
from tracekit.errors import ConfigError

KINDS = ("full", "prefix", "chunked", "decode")


@dataclass(frozen=True)
class History:
    """A history resolved for one sequence: its label as written to the trace,
    its segment ends (ascending; the last is the number of inputs), and the
    reused-prefix boundary written as the row's cached_tokens."""

    label: str
    ends: tuple[int, ...]
    cached_tokens: int


@dataclass(frozen=True)
class HistorySpec:
    """One `--history` item. size: B for prefix (None = auto), C for chunked."""

    kind: str
    size: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "prefix":
            return f"prefix:{'auto' if self.size is None else self.size}"
        if self.kind == "chunked":
            return f"chunked:{self.size}"
        return self.kind

    def resolve(self, prompt_len: int, n_tokens: int, cached_tokens: int = -1) -> History | None:
        """The history for a sequence of prompt_len + n_tokens tokens, or None when
        it does not apply (prefix boundary unknown, zero or past the inputs)."""
        n_inputs = prompt_len + n_tokens - 1
        if prompt_len < 1 or n_tokens < 1:
            raise ValueError(f"a sequence needs >= 1 prompt and >= 1 generated token, got {prompt_len}, {n_tokens}")
        if self.kind == "full":
            return History("full", (n_inputs,), 0)
        if self.kind == "decode":
            return History("decode", tuple(range(prompt_len, n_inputs + 1)), 0)
        if self.kind == "chunked":
            c = int(self.size)
            return History(self.label, tuple(range(c, n_inputs, c)) + (n_inputs,), 0)
        b = cached_tokens if self.size is None else self.size
        if b <= 0 or b >= n_inputs:
            return None
        return History(f"prefix:{b}", (b, n_inputs), b)

    def why_not(self, prompt_len: int, n_tokens: int, cached_tokens: int = -1) -> str:
        """Why `resolve` gave None, in words (the note a skipped history carries)."""
        n_inputs = prompt_len + n_tokens - 1
        auto = self.size is None
        b = cached_tokens if auto else self.size
        if auto and b < 0:
            return "the trace holds no cached-token count for this request (-1: not reported); give prefix:B"
        if b == 0:
            return "the trace's cached_tokens is 0 (nothing reused): that history is `full`"
        if b >= n_inputs:
            return f"boundary {b} is not inside the {n_inputs} inputs"
        return "applies"


def parse_history(text: str) -> HistorySpec:
    """Parse one history item: full | prefix:B | prefix:auto | chunked:C | decode."""
    item = text.strip()
    kind, _, arg = item.partition(":")
    if kind in ("full", "decode") and not arg:
        return HistorySpec(kind)
    if kind == "prefix" and arg == "auto":
        return HistorySpec("prefix", None)
    if kind in ("prefix", "chunked") and arg.isdigit() and int(arg) > 0:
        return HistorySpec(kind, int(arg))
    raise ConfigError(
        f"bad history {item!r}: expected one of full, prefix:B, prefix:auto, chunked:C, decode "
        "(B and C positive token counts)"
    )


def parse_histories(text: str) -> tuple[HistorySpec, ...]:
    """Parse a comma-separated `--history` list, keeping order and dropping repeats."""
    specs: list[HistorySpec] = []
    for item in text.split(","):
        if not item.strip():
            continue
        spec = parse_history(item)
        if spec not in specs:
            specs.append(spec)
    if not specs:
        raise ConfigError("--history is empty: give at least one of full, prefix:B, prefix:auto, chunked:C, decode")
    return tuple(specs)


def parse_dtypes(text: str) -> tuple[str, ...]:
    """A comma-separated `--dtype` list (tracekit/dtypes.py names), in order, without repeats."""
    out: list[str] = []
    for item in (s.strip().lower() for s in text.split(",")):
        if not item:
            continue
        if item not in dtypes.DTYPES:
            raise ConfigError(f"bad dtype {item!r}: expected a comma-separated list of {', '.join(dtypes.NAMES)}")
        if item not in out:
            out.append(item)
    if not out:
        raise ConfigError(f"--dtype is empty: give one or more of {', '.join(dtypes.NAMES)}")
    return tuple(out)
