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

from .base import BAD_VALUE, Acc, RequestSpec, check_error, usage_into


def _str_mode(acc: Acc) -> None:
    if acc.strs is None:
        acc.strs = ["" for _ in acc.ids]
        acc.top_strs = [[] for _ in acc.ids]


def _entries(content: list, acc: Acc, t: float) -> None:
    """Chat-style `content[]` entries: one per token."""
    for e in content:
        tops = e.get("top_logprobs") or ()
        if "id" in e:
            acc.ids.append(e["id"])
            acc.top_ids.append([d["id"] for d in tops])
            if acc.strs is not None:
                acc.strs.append(e["token"])
                acc.top_strs.append([])
        elif e["token"][:9] == "token_id:":  # vLLM chat with return_tokens_as_token_ids
            acc.ids.append(int(e["token"][9:]))
            acc.top_ids.append([int(d["token"][9:]) for d in tops])
            if acc.strs is not None:
                acc.strs.append(e["token"])
                acc.top_strs.append([])
        else:
            _str_mode(acc)
            tok = e.get("bytes")
            acc.strs.append(bytes(tok) if tok is not None else e["token"])
            acc.top_strs.append([bytes(d["bytes"]) if d.get("bytes") is not None else d["token"] for d in tops])
            acc.ids.append(-1)
            acc.top_ids.append([-1] * len(tops))
        acc.lps.append(e["logprob"])
        acc.top_lps.append([d["logprob"] for d in tops])
        acc.t.append(t)


def _legacy(lp: dict, acc: Acc, t: float, token_ids: list | None) -> None:
    """Legacy arrays: the chosen strings as they come, the top-k dicts into Acc's compact
    form (converted in bulk at the end). vLLM's `token_ids` give the chosen ids directly."""
    tokens = lp.get("tokens") or ()
    if acc.tok_strs is None:
        acc.start_legacy()
    n = len(tokens)
    acc.lps.extend(lp.get("token_logprobs") or ())
    acc.tok_strs.extend(tokens)
    acc.add_tops(lp.get("top_logprobs") or [{}] * n)
    if token_ids and len(token_ids) == n and len(acc.ids) == len(acc.tok_strs) - n:
        acc.ids.extend(token_ids)
    if n == 1:
        acc.t.append(t)
    else:
        acc.t.extend([t] * n)


def _choice(ch: dict, acc: Acc, t: float) -> None:
    lp = ch.get("logprobs")
    n0 = len(acc.lps)
    if lp:
        if "content" in lp:
            _entries(lp["content"] or (), acc, t)
        else:
            _legacy(lp, acc, t, ch.get("token_ids"))
        logits = lp.get("top_logits")
        if logits is not None:
            if acc.top_logits is None:
                acc.top_logits = [[] for _ in range(n0)]
            acc.top_logits.extend(logits)
            # tracekit serve sends the top-k ids aligned with top_logits (string keys can collide).
            tti = lp.get("top_token_ids")
            if tti is not None:
                acc.top_ids.extend(tti)
        elif acc.top_logits is not None:
            acc.top_logits.extend([] for _ in range(len(acc.lps) - n0))
    elif ch.get("token_ids"):
        # vLLM with return_token_ids but no logprobs asked: ids without logprobs.
        acc.add_bare_ids(ch["token_ids"], t)
    if "prompt_token_ids" in ch and ch["prompt_token_ids"]:
        acc.prompt_ids = list(ch["prompt_token_ids"])
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
        """One stream event. The hot event, one legacy-layout token with vLLM's "token_id:N"
        keys and nothing else, is handled inline: exactly what _choice -> _legacy ->
        Acc.add_tops do for it, without their calls and checks (~1 us a token; parsing a
        chunk's events first and handling them after was slower: cache misses)."""
        if acc.top_keys is not None and acc.top_logits is None and type(obj) is dict and "error" not in obj:
            try:  # the shape, by subscripts and 1-unpacking (cheaper than .get and len checks)
                (ch,) = obj["choices"]
                lp = ch["logprobs"]
                (tok,) = lp["tokens"]
                (d,) = lp["top_logprobs"]
                tl = lp["token_logprobs"]
            except (KeyError, TypeError, ValueError):
                pass
            else:
                if (
                    "content" not in lp
                    and "top_logits" not in lp
                    and "prompt_token_ids" not in ch
                    and not obj.get("usage")
                    and not obj.get("prompt_token_ids")
                    and ch.get("index", 0) == 0
                ):
                    keys = " ".join(d)
                    if keys[:9] == "token_id:":  # other keys may hold spaces: the checked path
                        acc.lps.extend(tl or ())
                        acc.tok_strs.append(tok)
                        acc.top_keys.append(keys)
                        acc.top_vals.extend(d.values())
                        acc.top_w.append(len(d))
                        ids = ch.get("token_ids")
                        if ids and len(ids) == 1 and len(acc.ids) == len(acc.tok_strs) - 1:
                            acc.ids.append(ids[0])
                        acc.t.append(t)
                        fr = ch.get("finish_reason")
                        if fr:
                            acc.finish_reason = fr
                        return
        self._parse_general(obj, acc, t)

    def _parse_general(self, obj: dict, acc: Acc, t: float) -> None:
        check_error(obj)
        for ch in obj.get("choices") or ():
            if ch.get("index", 0) == 0:
                _choice(ch, acc, t)
        if obj.get("prompt_token_ids"):
            acc.prompt_ids = list(obj["prompt_token_ids"])
        usage_into(obj.get("usage"), acc)

    parse_response = _parse_general


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
