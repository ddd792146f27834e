"""The OpenAI / vLLM completions dialect: parse a request body, build response objects.

Parsing is one function that either returns frozen `CompletionParams` or raises
`BadRequest` (-> HTTP 400 with an OpenAI-style error body). Response building
follows the legacy completions layout (`logprobs.{tokens, token_logprobs,
top_logprobs, text_offset}`) plus the vLLM extras and tracekit's raw-logit
extension, documented in docs/engine.md.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [lo, hi)


class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        err_type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.err_type, self.code = message, param, status, err_type, code

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(
    message: str, err_type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionParams:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None  # None = no logprobs object
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool
    ignore_eos: bool
    raw_logits: bool
    model: str | None
    prompt_logprobs: int | None = None  # vLLM's: each prompt position's logprob and top-k
    forced: tuple[int, ...] = ()  # tracekit's teacher forcing: feed these ids back, one per step


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise BadRequest(f"'{name}' must be at least {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be at most {hi}, got {v}", name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _prompt_ids(body: dict, tokenizer, vocab_size: int) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise BadRequest("'prompt' is empty", "prompt")
        _check_text(p, "prompt")
        ids = tokenizer.encode(p, add_special_tokens=False)
        if not ids:
            raise BadRequest("'prompt' encodes to no tokens", "prompt")
        return ids
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} in 'prompt' is outside the vocabulary [0, {vocab_size})", "prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise BadRequest("batched prompts are not supported: send one prompt per request", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _check_text(text: str, name: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which are not Unicode text: no tokenizer or
    UTF-8 encoder takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise BadRequest(
            f"'{name}' holds a lone surrogate \\u{ord(bad):04x} at character {e.start}: not valid Unicode text",
            name,
        ) from None


def parse_completion(body, tokenizer, vocab_size: int, max_context: int) -> CompletionParams:
    """Validate a /v1/completions body. Raises BadRequest with the offending parameter."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    ids = _prompt_ids(body, tokenizer, vocab_size)
    max_tokens = _int(body, "max_tokens", 16, lo=1)
    if len(ids) + max_tokens > max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            "prompt",
            code="context_length_exceeded",
        )
    temp = body.get("temperature", 1.0)
    if temp is None:
        temp = 1.0
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not 0 <= temp <= 2:
        raise BadRequest(f"'temperature' must be a number in [0, 2], got {temp!r}", "temperature")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    for s_ in stop:
        _check_text(s_, "stop")
    if _int(body, "n", 1, lo=1, hi=1) != 1 or _int(body, "best_of", 1, lo=1, hi=1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    if _bool(body, "echo"):
        raise BadRequest("'echo' is not supported", "echo")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    prompt_logprobs = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is not None and _bool(body, "stream"):
        raise BadRequest("'prompt_logprobs' is not available when 'stream' is true (as in vLLM)", "prompt_logprobs")
    forced = _forced(body, vocab_size)
    if forced:
        if "max_tokens" not in body or body.get("max_tokens") is None:
            max_tokens = len(forced)
        elif max_tokens != len(forced):
            raise BadRequest(
                f"'max_tokens' ({max_tokens}) must equal the number of 'forced_tokens' ({len(forced)})", "max_tokens"
            )
        if len(ids) + max_tokens > max_context:
            raise BadRequest(f"prompt plus 'forced_tokens' exceed the context ({max_context} tokens)", "forced_tokens")
    return CompletionParams(
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        temperature=float(temp),
        seed=_int(body, "seed", None, lo=SEED_RANGE[0], hi=SEED_RANGE[1] - 1),
        stop=tuple(stop),
        logprobs=logprobs,
        stream=_bool(body, "stream"),
        include_usage=bool(so.get("include_usage", False)),
        return_token_ids=_bool(body, "return_token_ids"),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        raw_logits=_bool(body, "return_raw_logits"),
        model=model if isinstance(model, str) else None,
        prompt_logprobs=prompt_logprobs,
        forced=forced,
    )


def _forced(body: dict, vocab_size: int) -> tuple[int, ...]:
    """tracekit's teacher-forcing extension: `forced_tokens`, token ids the engine feeds back
    instead of its own choices (the traced tokens of a replay); each step still reports the
    model's logprob and logit of the forced id and its own top-k."""
    v = body.get("forced_tokens")
    if v is None:
        return ()
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BadRequest("'forced_tokens' must be a non-empty list of token ids", "forced_tokens")
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        msg = f"token id {bad[0]} in 'forced_tokens' is outside the vocabulary [0, {vocab_size})"
        raise BadRequest(msg, "forced_tokens")
    return tuple(v)


def prompt_logprobs_list(p: CompletionParams, rows, n_prompt: int, token_str) -> list:
    """vLLM's `prompt_logprobs`: one entry per prompt position, None for position 0 and for every
    position whose logits the engine did not compute (inside the reused prefix: tracekit serve
    reads the prefix cache for these requests too, vLLM does not). An entry maps token id (a
    string key in JSON) -> {logprob, rank, decoded_token}: the prompt token first, then the top-k
    by rank; with return_raw_logits each also carries `logit` (tracekit's extension)."""
    out: list = [None] * n_prompt
    for row in rows:
        entry = {str(row.token_id): _lp_entry(row.logprob, row.rank, token_str(row.token_id), row.logit, p)}
        for rank, (t, lp, lg) in enumerate(zip(row.top_ids, row.top_logprobs, row.top_logits), start=1):
            entry.setdefault(str(t), _lp_entry(lp, rank, token_str(t), lg, p))
        out[row.pos] = entry
    return out


def _lp_entry(lp: float, rank: int, tok: str, logit: float, p: CompletionParams) -> dict:
    e = {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": tok}
    if p.raw_logits:
        e["logit"] = logit
    return e


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def envelope(cid: str, model: str, choices: list, usage: dict | None = None) -> dict:
    out = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class LogprobsBuilder:
    """Accumulates the legacy `logprobs` object for a span of tokens (a whole response or one chunk)."""

    def __init__(self, p: CompletionParams, token_str):
        self.p, self.token_str = p, token_str
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.token_logits, self.top_ids, self.top_logits = [], [], []

    def add(self, ev, text_offset: int) -> None:
        self.tokens.append(self.token_str(ev.token_id))
        self.token_logprobs.append(ev.logprob)
        self.top_logprobs.append({self.token_str(t): lp for t, lp in zip(ev.top_ids, ev.top_logprobs)})
        self.text_offset.append(text_offset)
        if self.p.raw_logits:
            self.token_logits.append(ev.logit)
            self.top_ids.append(list(ev.top_ids))
            self.top_logits.append(list(ev.top_logits))

    def build(self) -> dict:
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        if self.p.raw_logits:
            out.update(token_logits=self.token_logits, top_token_ids=self.top_ids, top_logits=self.top_logits)
        return out
