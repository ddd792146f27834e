"""SGLang's native `/generate` route.

Asks with `return_logprob: true, top_logprobs_num: k, logprob_start_len: -1`
(output positions only). Tokens come as `meta_info.output_token_logprobs =
[[logprob, id, text|null], ...]` and `meta_info.output_top_logprobs =
[[[logprob, id, text], ...k], ...]`; the reused prefix is
`meta_info.cached_tokens`. Streaming sends `data:` events and `[DONE]`; unless
the server runs with `--incremental-streaming-output` the logprob lists are
cumulative, so the parser takes only the entries past what it has consumed
(`acc.seen`), which is right for both modes.

A text prompt also asks `return_prompt_token_ids: true`: every answer (each stream event) then
carries the ids the engine tokenized it to, at the top level as `prompt_token_ids`
(sglang/srt/managers/tokenizer_manager.py, SGLang 0.5.23). An SGLang without that field
ignores the key (unknown top-level keys of /generate are ignored) and sends no ids: the run's
own look-up (the engine's /tokenize, else --tokenizer) fills them in (capture/client.py).
"""

from __future__ import annotations

from typing import Any

from tracekit.errors import ResponseShapeError

from .base import BAD_VALUE, Acc, RequestSpec, check_error


class SGLangGenerate:
    name = "sglang"
    done_marker = True
    bad_status = 400  # the /generate contract check answers 400 before any stream starts

    def route(self, stream: bool) -> str:
        return "/generate"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": spec.max_tokens, "temperature": spec.temperature}
        if spec.ignore_eos:
            sp["ignore_eos"] = True
        b: dict[str, Any] = {
            "sampling_params": sp,
            "stream": spec.stream,
            "return_logprob": True,
            "top_logprobs_num": spec.top_logprobs,
            "logprob_start_len": -1,
        }
        if isinstance(spec.prompt, str):
            b["text"], b["return_prompt_token_ids"] = spec.prompt, True
        else:
            b["input_ids"] = spec.prompt
        b.update(spec.extra)
        return b

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        b = self.body(spec)
        return {**b, "sampling_params": {**b["sampling_params"], "max_new_tokens": BAD_VALUE}}

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        check_error(obj)
        meta = obj.get("meta_info") or {}
        out = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        done = meta.get("completion_tokens")
        # Cumulative lists hold every token so far (len == completion_tokens);
        # incremental ones only the new ones. Either way skip what was seen.
        start = acc.seen if isinstance(done, int) and len(out) == done else 0
        if type(out) is not list or type(tops) is not list:
            raise ResponseShapeError("meta_info.output_token_logprobs / output_top_logprobs are not lists")
        for i in range(start, len(out)):
            row = tops[i] if i < len(tops) and tops[i] else ()
            try:
                (lp, tid, *_), ids, vals = out[i], [r[1] for r in row], [r[0] for r in row]
            except (TypeError, ValueError, IndexError):
                raise ResponseShapeError(f"output logprob entry {i} is not [logprob, id, text]") from None
            acc.add(tid, lp, ids, vals, t)
        acc.seen = len(acc.lps)
        pids = obj.get("prompt_token_ids")  # the same list on every event, with return_prompt_token_ids
        if pids and acc.prompt_ids is None:
            if type(pids) is not list:
                raise ResponseShapeError("prompt_token_ids is not a list")
            acc.prompt_ids = list(pids)
        if isinstance(meta.get("cached_tokens"), int):
            acc.cached_tokens = meta["cached_tokens"]
        fr = meta.get("finish_reason")
        if fr:
            acc.finish_reason = fr.get("type", "") if isinstance(fr, dict) else str(fr)

    parse_response = parse_event
