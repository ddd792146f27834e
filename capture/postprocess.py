"""What the run does to each finished outcome before it is written.

- logits in the logprob fields (vLLM `--logprobs-mode *_logits`) move to the raw-logit column;
- ids the engine sent as strings that stay unknown (-1) are noted on the row, chosen tokens and
  top-k candidates counted apart (llama-cpp-python sends an EOS as '' in its top_logprobs: a
  candidate with a value and no id, which the diff cannot place);
- an answer the trace cannot hold (a finish reason over 16 bytes or not ASCII, error text with
  a lone surrogate, ids outside int32: `tracekit.store.check_request`) becomes an `error` row
  that says why, so one bad response never stops the capture (the writer refuses a whole group
  for one such row).

No I/O: warnings go through the run's `Pitfalls` (capture/pitfalls.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from tracekit.errors import TraceFormatError
from tracekit.schema import Layout, TokenColumns
from tracekit.store import check_request
from tracekit.text import clip

from .client import ERROR_EXCERPT, Outcome
from .dialects import RequestSpec


class Post:
    """Callable on each finished outcome: logits moved, unknown ids noted, pitfalls said once."""

    def __init__(self, tokenizer: str | None, logits_mode: bool, layout: Layout, warn, watch=None):
        self.tokenizer, self.logits_mode, self.layout, self.warn = tokenizer, logits_mode, layout, warn
        self.watch = watch  # pitfalls.Watch: sees each outcome as it will be stored
        self.unknown = 0  # tokens of ok rows with id -1
        self.unknown_topk = 0  # top-k candidates of ok rows with a value but id -1

    def __call__(self, outcome: Outcome, spec: RequestSpec) -> Outcome:
        if self.logits_mode and outcome.tokens is not None:
            outcome = Outcome(outcome.record, _as_logits(outcome.tokens), outcome.prompt_ids)
        outcome = storable(self._unknown_ids(outcome), self.layout)
        if self.watch is not None:
            self.watch.seen(spec, outcome)
        return outcome

    def _unknown_ids(self, outcome: Outcome) -> Outcome:
        toks = outcome.tokens
        if toks is None or outcome.record.status != "ok":
            return outcome
        tid = toks.token_id
        if (not len(tid) or tid.min() >= 0) and (not toks.topk_id.size or toks.topk_id.min() >= 0):
            return outcome  # every id known (one reduction a column: the common case)
        n = int((tid < 0).sum())
        topk = unmapped_topk(toks)
        if not n and not topk.any():
            return outcome
        if not n:
            pass
        elif self.tokenizer:
            self.warn(
                "tokenizer_mismatch",
                f"the engine sent token strings that are not in the vocabulary of {self.tokenizer} (their ids "
                "stay unknown, -1): the tokenizer does not round-trip the engine's tokens; is it the served "
                "model's tokenizer?",
            )
        else:
            self.warn(
                "token_ids_unknown",
                "the engine sent token strings without ids; ids stay unknown (-1); pass --tokenizer DIR (the "
                "served model's tokenizer), or --dialect vllm for a vLLM server",
            )
        notes = []
        why = f"not in the vocabulary of {self.tokenizer}" if self.tokenizer else "pass --tokenizer DIR"
        if n:
            self.unknown += n
            notes.append(f"token ids unknown for {n} tokens: the engine sent token strings only; {why}")
        if topk.any():
            k, rows = int(topk.sum()), int((topk > 0).sum())
            self.unknown_topk += k
            notes.append(f"{k} top-k candidates in {rows} of {len(topk)} positions have no id ({why})")
            self.warn(
                "topk_ids_unknown",
                "top-k candidates came as token strings that map to no id (stored as -1 with their logprob; "
                "llama-cpp-python sends an EOS as ''): a flip to such a candidate has no id to compare; each "
                "row's error field counts them",
            )
        note = "; ".join(notes)
        rec = outcome.record
        return Outcome(
            dataclasses.replace(rec, error=f"{rec.error}; {note}" if rec.error else note), toks, outcome.prompt_ids
        )


def unmapped_topk(toks: TokenColumns) -> np.ndarray:
    """[n] per position, the top-k candidates with a value (logprob or logit) but no id (-1)."""
    known = ~np.isnan(toks.topk_logprob)
    if toks.topk_logit is not None:
        known |= ~np.isnan(toks.topk_logit)
    return ((toks.topk_id < 0) & known).sum(axis=1)


def _as_logits(t: TokenColumns) -> TokenColumns:
    """The engine's logprob fields held logits (vLLM --logprobs-mode *_logits): the values become
    the raw top-k logits; the logprobs are unknown (NaN), never logits under a logprob name."""
    nan = np.full_like(t.topk_logprob, np.nan)
    return dataclasses.replace(
        t, logprob=np.full_like(t.logprob, np.nan), topk_logprob=nan, topk_logit=t.topk_logprob.copy()
    )


def _text(s) -> str:
    """Text the trace can hold: a lone surrogate (JSON's "\\ud800") written as its escape."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(s, str) else repr(s)


def _reason(e: TraceFormatError, key: str) -> str:
    """The store's refusal without its 'where: request KEY:' frame."""
    msg = str(e).removeprefix(f"response: request {key!r:.80}: ")
    return _text(msg.removesuffix("; the trace cannot hold it (docs/format.md)"))


def _fallbacks(outcome: Outcome, why: str) -> Iterator[Outcome]:
    """Ever smaller error rows: every field kept but the text made storable; then without the
    finish reason and cached count; then without tokens and prompt ids."""
    rec = outcome.record
    note = f"the trace cannot hold the engine's answer as it came: {why}"
    error = clip(_text(f"{rec.error}; {note}" if rec.error else note), ERROR_EXCERPT)
    rec = dataclasses.replace(
        rec, status="error", error=error, params=_text(rec.params), prompt_text=_text(rec.prompt_text)
    )
    yield Outcome(rec, outcome.tokens, outcome.prompt_ids)
    rec = dataclasses.replace(rec, finish_reason="", cached_tokens=-1)
    yield Outcome(rec, outcome.tokens, outcome.prompt_ids)
    yield Outcome(dataclasses.replace(rec, prompt_len=-1), None, None)


def storable(outcome: Outcome, layout: Layout) -> Outcome:
    """The outcome if the trace can hold it; else the first fallback error row it can hold (the
    store's reason in `error`); either carries its checked row (`Outcome.row`). Raises only when
    not even a bare row fits (a key the prompt file check lets through cannot do that)."""
    try:
        return _with_row(outcome, layout)
    except TraceFormatError as e:
        first = e
        why = _reason(e, outcome.record.key)
    for row in _fallbacks(outcome, why):
        try:
            return _with_row(row, layout)
        except TraceFormatError:
            continue
    raise first


def _with_row(outcome: Outcome, layout: Layout) -> Outcome:
    """The outcome with its checked row (`Outcome.row`: the writer does not check it again)."""
    row = check_request(outcome.record, outcome.tokens, outcome.prompt_ids, layout, "response")
    return Outcome(outcome.record, outcome.tokens, outcome.prompt_ids, row)
