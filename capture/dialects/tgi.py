"""Hugging Face TGI's `/generate` and `/generate_stream` routes.

Asks with `parameters: {details: true, top_n_tokens: k, do_sample: false}`
(TGI rejects temperature 0; greedy is `do_sample: false`). TGI **refuses** a k
above its launcher's `--max-top-n-tokens` (5 by default) with a 422, it does not
cap it, and `/info` does not report the limit: `top_n_probe` asks it before a
capture starts. Tokens: non-stream
`details.tokens[].{id, text, logprob, special}` and `details.top_tokens[][]`;
stream events `{index, token{...}, top_tokens[], generated_text, details}` with
text and details only on the last event, which ends the stream (no `[DONE]`).
TGI reports no cached prompt tokens (cached_tokens stays -1) and has no
ignore-EOS switch; prompts must be text.
"""

from __future__ import annotations

import re
from typing import Any

from tracekit.errors import ConfigError, ResponseShapeError

from .base import BAD_VALUE, Acc, RequestSpec, check_error


def _token(tok: Any, tops: Any, acc: Acc, t: float) -> None:
    if type(tok) is not dict or "id" not in tok or "logprob" not in tok:
        raise ResponseShapeError(f"a TGI token without 'id' and 'logprob': {tok!r:.120}")
    acc.add_token(tok["id"], tok["logprob"], tops, t)


class TGIGenerate:
    name = "tgi"
    done_marker = False  # the event with `details` is the last
    bad_status = 422  # TGI's JSON extractor rejects a wrong-typed field with 422

    def route(self, stream: bool) -> str:
        return "/generate_stream" if stream else "/generate"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        if not isinstance(spec.prompt, str):
            raise ConfigError(f"prompt {spec.key!r}: TGI takes text prompts only, got token ids")
        params: dict[str, Any] = {
            "max_new_tokens": spec.max_tokens,
            "details": True,
            "do_sample": False,
            "decoder_input_details": False,
        }
        if spec.top_logprobs:
            params["top_n_tokens"] = spec.top_logprobs
        params.update(spec.extra)
        return {"inputs": spec.prompt, "parameters": params, "stream": spec.stream}

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        b = self.body(spec)
        return {**b, "parameters": {**b["parameters"], "max_new_tokens": BAD_VALUE}}

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        check_error(obj)
        tok = obj.get("token")
        if tok:
            _token(tok, obj.get("top_tokens") or (), acc, t)
        details = obj.get("details")
        if details:
            acc.done = True
            acc.finish_reason = _finish(details.get("finish_reason", ""))

    def parse_response(self, obj: Any, acc: Acc, t: float) -> None:
        if isinstance(obj, list) and obj:
            obj = obj[0]  # the `/` route answers a list
        check_error(obj)
        details = obj.get("details") or {}
        tops = details.get("top_tokens") or []
        for i, tok in enumerate(details.get("tokens") or ()):
            _token(tok, tops[i] if i < len(tops) else (), acc, t)
        acc.done = True
        acc.finish_reason = _finish(details.get("finish_reason", ""))


def _finish(reason: str) -> str:
    # TGI says eos_token / stop_sequence / length.
    return {"eos_token": "stop", "stop_sequence": "stop"}.get(reason, reason)


def top_n_probe(k: int) -> dict[str, Any]:
    """A /generate body that asks TGI whether it allows top_n_tokens k and generates nothing:
    router/src/validation.rs checks top_n_tokens before it refuses the empty input, so the 422
    names top_n_tokens when k is above --max-top-n-tokens, else the empty input."""
    return {"inputs": "", "parameters": {"max_new_tokens": 1, "do_sample": False, "top_n_tokens": k}}


def top_n_refusal(k: int, status: int, text: str) -> str | None:
    """What to tell the user when TGI's answer to top_n_probe(k) refuses k; None otherwise."""
    if status != 422 or "top_n_tokens" not in text:
        return None
    m = re.search(r"<= (\d+)", text)
    most = f"--top-logprobs {m.group(1)} or less" if m else "a smaller --top-logprobs"
    return (
        f"TGI refuses top_n_tokens {k} (above its --max-top-n-tokens; it rejects such requests, it does not "
        f"cap them): capture with {most}, or start TGI with --max-top-n-tokens {k}"
    )
