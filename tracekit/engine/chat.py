"""The OpenAI chat-completions dialect of the reference engine: parse `messages`, build chat
responses and chat-shaped logprobs (`choices[].logprobs.content[].{token, logprob, bytes,
top_logprobs[]}`), so the chat dialect of `tracekit capture` is tested end to end here.

The prompt is the tokenizer's own chat template when it has one; otherwise (the fixture model has
none) a plain documented layout: each message as `<|ROLE|>\\nCONTENT\\n`, then `<|assistant|>\\n`.
Everything else (sampling, stop, seed, ignore_eos, return_token_ids, usage) is the completions
route's (protocol.parse_completion), so both routes run the same generation.
"""

from __future__ import annotations

import time

from .protocol import MAX_LOGPROBS, BadRequest, CompletionParams, _bool, _check_text, _int, parse_completion

ROLES = ("system", "user", "assistant", "developer", "tool")


def render_messages(messages, tokenizer) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with a role in {', '.join(ROLES)} and string content", "messages"
            )
        _check_text(m["content"], "messages")
        norm.append({"role": m["role"], "content": m["content"]})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(norm, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in norm) + "<|assistant|>\n"


def parse_chat(body, tokenizer, vocab_size: int, max_context: int) -> CompletionParams:
    """Validate a /v1/chat/completions body: `logprobs` is a boolean and `top_logprobs` its width
    (0-20, OpenAI's limit); `max_completion_tokens` is the newer name of `max_tokens`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompt = render_messages(body.get("messages"), tokenizer)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    inner = {k: v for k, v in body.items() if k not in ("messages", "logprobs", "top_logprobs", "prompt")}
    if "max_completion_tokens" in inner and inner.get("max_tokens") is None:
        inner["max_tokens"] = inner.pop("max_completion_tokens")
    inner.pop("max_completion_tokens", None)
    for name in ("prompt_logprobs", "forced_tokens", "echo"):
        if inner.get(name) is not None:
            raise BadRequest(f"'{name}' is served on /v1/completions only", name)
    inner["prompt"] = prompt
    if want:
        inner["logprobs"] = top or 0
    return parse_completion(inner, tokenizer, vocab_size, max_context)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprob_entry(ev, tokenizer, p: CompletionParams) -> dict:
    """One content[] element: the chosen token and its top_logprobs (ids as strings with
    return_tokens_as_token_ids, `token_id:N`, as vLLM; raw logits with return_raw_logits)."""

    def tok(t: int) -> str:
        return f"token_id:{t}" if p.tokens_as_ids else _token_text(tokenizer, t)

    def one(t: int, lp: float, logit: float) -> dict:
        s = tok(t)
        e = {"token": s, "logprob": max(lp, -9999.0), "bytes": list(s.encode("utf-8"))}
        if p.raw_logits:
            e["logit"] = logit
        return e

    entry = one(ev.token_id, ev.logprob, ev.logit)
    entry["top_logprobs"] = [one(t, lp, lg) for t, lp, lg in zip(ev.top_ids, ev.top_logprobs, ev.top_logits)]
    return entry


def chat_response(cid: str, model: str, text: str, content, finish, stop_reason, usage_obj: dict) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None if content is None else {"content": content},
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_obj,
    }


def chat_chunk(cid: str, model: str, delta, content, finish, p: CompletionParams, **extra) -> dict:
    choice = {
        "index": 0,
        "delta": delta or {},
        "logprobs": None if content is None else {"content": content},
        "finish_reason": finish,
        **extra,
    }
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    out["choices"] = [choice]
    if p.include_usage:
        out["usage"] = None
    return out
