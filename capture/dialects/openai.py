"""OpenAI-compatible routes: `/v1/completions` (openai), `/v1/chat/completions`
(openai-chat) and vLLM's extras on the completions route (vllm).

Two logprob layouts reach these routes and both are accepted on either:
- legacy completions arrays: `logprobs.{tokens[], token_logprobs[], top_logprobs[{str: lp}]}`
  (strings only; vLLM's `return_tokens_as_token_ids` makes them "token_id:123");
- chat-style `logprobs.content[].{token, logprob, bytes, top_logprobs[]}` (OpenAI chat;
  llama.cpp sends this with an `id` even on /v1/completions).
Where only strings come back, the chosen and top-k strings are kept and mapped
to ids with the model's tokenizer at the end of the request (capture/tokens.py).
The reference engine (`tracekit serve`), asked with `return_raw_logits: true`,
adds `logprobs.top_logits` [n][k] with the aligned `top_token_ids` [n][k] (and
`token_logits`, unused here), see docs/engine.md.
"""

from __future__ import annotations

from typing import Any

from tracekit.errors import ResponseShapeError

from .acc import TOKEN_ID, Acc
from .base import BAD_VALUE, RequestSpec, check_error, usage_into


def _entries(content: Any, acc: Acc, t: float) -> None:
    """Chat-style `content[]` entries, one a token: ids from `id` (llama.cpp), else the
    "token_id:N" token (vLLM), else the token's bytes or text (mapped at the end)."""
    if type(content) is not list:
        raise ResponseShapeError("logprobs.content is not a list")
    for e in content:
        if type(e) is not dict or "logprob" not in e or ("id" not in e and "token" not in e):
            raise ResponseShapeError(f"logprobs.content entry without 'logprob' and 'id'/'token': {str(e)[:120]}")
        tops = e.get("top_logprobs") or ()
        if type(tops) is not list or not all(type(d) is dict and "logprob" in d for d in tops):
            raise ResponseShapeError(f"top_logprobs of a content entry is not a list of objects: {tops!r:.120}")
        tok = _ident(e)
        acc.str_ids |= type(tok) is not int
        acc.ids.append(tok)
        acc.lps.append(e["logprob"])
        acc.t.append(t)
        acc.widths.append(len(tops))
        ids = [_ident(d) for d in tops]
        acc.str_tops |= any(type(i) is not int for i in ids)
        acc.top_ids += ids
        acc.top_vals += [d["logprob"] for d in tops]


def _ident(e: dict):
    """A content entry's or candidate's id, or the string that stands for it."""
    i = e.get("id")
    if type(i) is int:
        return i
    tok = e.get("token")
    if type(tok) is str and tok.startswith(TOKEN_ID):
        return tok
    raw = e.get("bytes")
    if raw is not None:
        try:
            return bytes(raw)
        except (TypeError, ValueError):
            raise ResponseShapeError(f"'bytes' of a token is not a list of bytes: {raw!r:.80}") from None
    if type(tok) is not str:
        raise ResponseShapeError(f"a logprobs entry without an integer 'id' or a 'token' string: {e!r:.120}")
    return tok


def _one_token(lp: dict, tokens: Any, token_ids: Any, acc: Acc, t: float) -> bool:
    """The hot path of `_legacy`: a stream event of exactly one token whose top_logprobs row is
    an object (vLLM's shape), without raw logits. Appends what `_legacy` would and returns True;
    anything else returns False having touched nothing (the general path then checks it)."""
    if type(tokens) is not list or len(tokens) != 1 or "top_logits" in lp:
        return False
    lps, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
    if type(lps) is not list or len(lps) != 1 or type(tops) is not list or len(tops) != 1:
        return False
    d = tops[0]
    if type(d) is not dict:
        return False
    if type(token_ids) is list and len(token_ids) == 1:
        acc.ids.append(token_ids[0])
    else:
        acc.ids.append(tokens[0])
        acc.str_ids = True
    acc.lps.append(lps[0])
    acc.t.append(t)
    acc.widths.append(len(d))
    acc.top_ids += d  # the keys
    acc.top_vals += d.values()
    acc.str_tops = True
    return True


def _legacy(lp: dict, tokens: Any, token_ids: Any, acc: Acc, t: float) -> None:
    """Legacy arrays `tokens[]`, `token_logprobs[]`, `top_logprobs[{str: lp}]`: the candidate
    strings (vLLM: "token_id:N") go into the flat lists as they come, resolved per request.
    vLLM's `token_ids` give the chosen ids directly."""
    lps, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
    if type(tokens) is not list or type(lps) is not list or len(lps) != len(tokens):
        raise ResponseShapeError("logprobs.tokens and logprobs.token_logprobs are not lists of one length")
    n = len(tokens)
    if tops is None:
        tops = (None,) * n
    elif type(tops) is not list or len(tops) != n:
        raise ResponseShapeError(f"logprobs.top_logprobs holds {len(tops)} rows for {n} tokens")
    if type(token_ids) is list and len(token_ids) == n:
        acc.ids += token_ids
    else:
        acc.ids += tokens
        acc.str_ids = True
    acc.lps += lps
    if n == 1:  # the streaming case: one token an event
        acc.t.append(t)
    else:
        acc.t += [t] * n
    widths, top_ids, top_vals = acc.widths, acc.top_ids, acc.top_vals
    for d in tops:
        if type(d) is dict:
            widths.append(len(d))
            top_ids += d  # the keys
            top_vals += d.values()
        elif d is None:  # vLLM sends null for a position without logprobs
            widths.append(0)
        else:
            raise ResponseShapeError(f"a top_logprobs row is a {type(d).__name__}, not an object")
    acc.str_tops = True


def _raw_logits(lp: dict, acc: Acc, start: int, first: int) -> None:
    """tracekit serve's `top_logits` [n][k], in the order of its `top_token_ids` [n][k], which is
    the order of the top_logprobs dict unless string keys collided (then that token's logits are
    NaN: never misaligned)."""
    logits, tti = lp.get("top_logits"), lp.get("top_token_ids")
    if acc.top_logits is None:
        acc.top_logits = [None] * start
    widths = acc.widths[first:]
    if type(logits) is not list or type(tti) is not list or len(logits) != len(widths) or len(tti) != len(widths):
        raise ResponseShapeError("logprobs.top_logits / top_token_ids do not have a row per token")
    for w, row, ids in zip(widths, logits, tti):
        acc.top_logits += row if len(row) == w == len(ids) else [None] * w


def _logprobs(lp: dict, tokens: Any, token_ids: Any, acc: Acc, t: float) -> None:
    """A choice's logprobs object in any layout, raw logits included (the general path)."""
    start, first = len(acc.top_vals), len(acc.widths)
    if tokens is not None:
        _legacy(lp, tokens, token_ids, acc, t)
    elif lp.get("content") is not None:
        _entries(lp["content"], acc, t)
    if acc.top_logits is not None or "top_logits" in lp:
        if lp.get("top_logits") is not None:
            _raw_logits(lp, acc, start, first)
        elif acc.top_logits is not None:
            acc.pad_logits(start)


def _choice(ch: Any, acc: Acc, t: float) -> None:
    if type(ch) is not dict:
        raise ResponseShapeError(f"a choice is a {type(ch).__name__}, not an object")
    if ch.get("index", 0) != 0:  # n > 1 is not asked for
        return
    lp = ch.get("logprobs")
    if lp:
        if type(lp) is not dict:
            raise ResponseShapeError("choices[].logprobs is not an object")
        tokens = lp.get("tokens")
        if acc.top_logits is not None or not _one_token(lp, tokens, ch.get("token_ids"), acc, t):
            _logprobs(lp, tokens, ch.get("token_ids"), acc, t)
    elif ch.get("token_ids"):
        # vLLM with return_token_ids but no logprobs asked: ids without logprobs.
        acc.add_bare_ids(ch["token_ids"], t)
    pids = ch.get("prompt_token_ids")  # vLLM: on the first chunk; null on the others (0.33)
    if pids:
        acc.prompt_ids = list(pids)
    fr = ch.get("finish_reason")
    if fr:
        acc.finish_reason = fr


class OpenAICompletions:
    name = "openai"
    done_marker = True
    bad_status = 400  # vLLM, SGLang's and llama.cpp's /v1 routes, tracekit serve: 400

    def route(self, stream: bool) -> str:
        return "/v1/completions"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        b: dict[str, Any] = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "stream": spec.stream,
        }
        if spec.model:
            b["model"] = spec.model
        b["logprobs"] = spec.top_logprobs  # even 0: the chosen tokens come inside the logprobs object
        if spec.stream:
            b["stream_options"] = {"include_usage": True}
        if spec.ignore_eos:
            b["ignore_eos"] = True  # not OpenAI; vLLM, SGLang, llama.cpp and tracekit serve accept it
        b.update(spec.extra)
        return b

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        return {**self.body(spec), "max_tokens": BAD_VALUE}

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        """One stream event, or a whole body: the same shape. Explicit nulls (vLLM 0.33 sends
        `prompt_token_ids`, `token_ids`, `weight_versions` as null on every chunk) mean absent."""
        if type(obj) is not dict or obj.get("error"):
            check_error(obj)
        choices = obj.get("choices")
        if choices:
            if type(choices) is not list:
                raise ResponseShapeError("'choices' is not a list")
            for ch in choices:
                _choice(ch, acc, t)
        pids = obj.get("prompt_token_ids")
        if pids:
            acc.prompt_ids = list(pids)
        usage = obj.get("usage")
        if usage:
            usage_into(usage, acc)

    parse_response = parse_event


class OpenAIChat(OpenAICompletions):
    name = "openai-chat"

    def route(self, stream: bool) -> str:
        return "/v1/chat/completions"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        if not isinstance(spec.prompt, str):
            from tracekit.errors import ConfigError

            raise ConfigError(f"prompt {spec.key!r}: the openai-chat dialect needs a text prompt, got token ids")
        b = super().body(spec)
        b["messages"] = [{"role": "user", "content": b.pop("prompt")}]
        b["logprobs"] = True
        b["top_logprobs"] = spec.top_logprobs
        b.update(spec.extra)
        return b


class VLLMCompletions(OpenAICompletions):
    """vLLM's completions route: ids come back as "token_id:N" strings and as
    `token_ids` / `prompt_token_ids` (return_token_ids, vLLM >= 0.10)."""

    name = "vllm"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        b = super().body(spec)
        b.setdefault("return_tokens_as_token_ids", True)
        b.setdefault("return_token_ids", True)
        return b
