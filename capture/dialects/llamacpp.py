"""llama.cpp's native `/completion` route (llama-server).

Asks with `n_probs: k`; each token comes as `completion_probabilities[]
.{id, token, bytes, logprob, top_logprobs[{id, token, bytes, logprob}]}`.
The reused prefix is `timings.cache_n` (the last prompt token is always
re-evaluated, so a full repeat shows len-1); `tokens_cached` is the slot's
whole cache after the request, not the boundary, and is not used. The stream
has **no `[DONE]`**: the last event carries `stop: true` and the timings; with
`truncated: true` and `stop_type: limit` the slot's context filled before `n_predict`,
and the row's finish reason is `context_limit`.
`cache_prompt` is sent only when the capture asks (`--cache-prompt/--no-cache-prompt`):
otherwise the server's own setting (`--cache-prompt`, its default, or `--no-cache-prompt`)
decides, which a per-request value would override. llama.cpp's `/v1/...` routes go through
the openai dialects.
"""

from __future__ import annotations

from typing import Any

from tracekit.errors import ResponseShapeError

from .base import BAD_VALUE, Acc, RequestSpec, check_error

# The finish reason of a stream the engine stopped at its context limit (llama.cpp's
# `truncated: true` with `stop_type: limit`); analyze/streams.py reads it.
CONTEXT_LIMIT = "context_limit"
# stop_type -> OpenAI-style finish reason.
_FINISH = {"limit": "length", "eos": "stop", "word": "stop"}


def _probs(entries: list, acc: Acc, t: float) -> None:
    if type(entries) is not list or not all(type(e) is dict and "id" in e and "logprob" in e for e in entries):
        raise ResponseShapeError("completion_probabilities is not a list of {id, logprob, ...}")
    for e in entries:
        acc.add_token(e["id"], e["logprob"], e.get("top_logprobs") or (), t)


class LlamaCppCompletion:
    name = "llamacpp"
    done_marker = False  # the last event has "stop": true instead
    bad_status = 400  # a field of the wrong type is std::invalid_argument: 400

    def route(self, stream: bool) -> str:
        return "/completion"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        b: dict[str, Any] = {
            "prompt": spec.prompt,
            "n_predict": spec.max_tokens,
            "temperature": spec.temperature,
            "n_probs": spec.top_logprobs,
            "stream": spec.stream,
            "return_tokens": True,
        }
        if spec.ignore_eos:
            b["ignore_eos"] = True
        if spec.cache_prompt is not None:
            # Only when asked: a request's cache_prompt overrides the server's --no-cache-prompt
            # (a per-request true made a cache-off server reuse prefixes, issue 24).
            b["cache_prompt"] = spec.cache_prompt
        b.update(spec.extra)
        return b

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        return {**self.body(spec), "n_predict": BAD_VALUE}  # -1 would be legal: no limit

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        check_error(obj)
        probs = obj.get("completion_probabilities")
        if probs:
            _probs(probs, acc, t)
        elif obj.get("tokens") and not obj.get("stop"):
            # n_probs 0: no probabilities, but stream events still carry `tokens: [id]`.
            acc.add_bare_ids(obj["tokens"], t)
        if obj.get("stop") is True:
            acc.done = True
            acc.finish_reason = _FINISH.get(obj.get("stop_type", ""), obj.get("stop_type", ""))
            if obj.get("truncated") is True and obj.get("stop_type") == "limit":
                # The slot's context filled up (prompt + output = n_ctx_slot) before n_predict:
                # the engine's context limit, not the request's, kept as its own finish reason.
                acc.finish_reason = CONTEXT_LIMIT
            timings = obj.get("timings") or {}
            if isinstance(timings.get("cache_n"), int):
                acc.cached_tokens = timings["cache_n"]

    parse_response = parse_event
