"""Pitfalls of a capture: what makes its evidence weaker than it looks, said at capture time.

Each pitfall is one `warning:` line on stderr, said once a run, and recorded in the run
metadata under `pitfalls` ([{code, message}]) so that reports show it. Known before any
request (`at_start`): requests that are not greedy, logprobs that are processed or of an
unknown mode, TGI's prefill logprobs, unknown EOS ids. Seen in the answers (`Watch`): no
per-request cached tokens, a top-k the engine capped, streams the engine cut at its context
limit; token strings the tokenizer cannot map
are said by capture/postprocess.py. Nothing here stops a run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .dialects import RequestSpec
from .dialects.llamacpp import CONTEXT_LIMIT

# Body fields that change the choice away from the argmax, and their neutral value.
_NEUTRAL = {
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,  # vLLM, SGLang, TGI, HF
    "repeat_penalty": 1.0,  # llama.cpp, llama-cpp-python
    "dry_multiplier": 0.0,  # llama.cpp's DRY repetition penalty
    "do_sample": False,  # TGI
}
FIRST_ANSWERS = 3  # ok answers without a cached-token count before the run says so


@dataclass(frozen=True)
class Pitfall:
    code: str
    message: str

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message}


class Pitfalls:
    """The run's pitfalls, in the order found; callable as `warn(code, message)`."""

    def __init__(self, out=None):
        self.out = out
        self.found: dict[str, Pitfall] = {}

    def __call__(self, code: str, message: str) -> None:
        if code in self.found:
            return
        self.found[code] = Pitfall(code, message)
        print(f"warning: {message}", file=self.out or sys.stderr)

    def as_list(self) -> list[dict]:
        return [p.as_dict() for p in self.found.values()]


def _not_greedy(spec: RequestSpec) -> list[str]:
    """What makes one request sample: its temperature and the sampling fields of its extra body
    (top level, or SGLang's `sampling_params` / TGI's `parameters`)."""
    fields = {"temperature": spec.temperature}
    for d in (spec.extra, spec.extra.get("sampling_params"), spec.extra.get("parameters")):
        if isinstance(d, dict):
            fields.update({k: v for k, v in d.items() if k in _NEUTRAL})
    out = []
    for k, v in fields.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if (number and v != _NEUTRAL[k]) or (k == "do_sample" and v is True):
            out.append(f"{k} {v:g}" if number else f"{k} {v}")
    return out


def at_start(specs: list[RequestSpec], run: dict, engine_kind: str, warn) -> None:
    """The pitfalls known from the plan and the engine's self-report, before any request."""
    sampled = [why for s in specs if (why := _not_greedy(s))]
    if sampled:
        shown = ", ".join(sorted({w for why in sampled for w in why})[:4])
        warn(
            "not_greedy",
            f"{len(sampled)} of {len(specs)} requests are not greedy ({shown}): the engine samples, so two "
            "runs differ by chance and the benign verdicts of `tracekit diff` (which check greedy choices) "
            "do not apply; capture with temperature 0 and no top-p, min-p or penalties (repetition_penalty / "
            "repeat_penalty 1, presence and frequency 0, dry_multiplier 0)",
        )
    mode, source = run.get("logprobs_mode"), str(run.get("logprobs_mode_source", ""))
    if mode in ("processed_logprobs", "processed_logits"):
        warn(
            "logprobs_processed",
            f"the engine's logprobs mode is {mode}: its values are taken after temperature and penalties, "
            "not from the model's own distribution; start vLLM with --logprobs-mode raw_logprobs (or raw_logits)",
        )
    elif run.get("dialect") == "vllm" and engine_kind != "tracekit" and source.startswith("default"):
        warn(
            "logprobs_mode_unknown",
            "vLLM does not say which --logprobs-mode it runs (only /server_info with VLLM_SERVER_DEV_MODE=1): "
            "assumed raw_logprobs, its default; pass --logprobs-mode to state it",
        )
    if run.get("dialect") == "tgi":
        warn(
            "tgi_prefill_logprobs",
            "TGI's prefill logprobs are off (its default; launcher --enable-prefill-logprobs): it does not "
            f"return the prompt's token ids, so they come from {run.get('prompt_ids', 'elsewhere')}",
        )
    if run.get("dialect") == "tgi" and any(s.ignore_eos for s in specs):
        # router/src/validation.rs (v3.3.7) sets ignore_eos_token false for every request.
        warn(
            "tgi_no_ignore_eos",
            "TGI has no ignore_eos switch: its streams end at the first EOS although the requests ask to ignore "
            "it; a diff against an engine that ignores EOS compares only up to that EOS",
        )
    asked = {s.cache_prompt for s in specs} - {None}
    if asked and run.get("dialect") != "llamacpp":
        warn(
            "cache_prompt_not_sent",
            f"--{'' if True in asked else 'no-'}cache-prompt is llama.cpp's per-request switch; the "
            f"{run.get('dialect')} dialect does not send it: set the engine's prefix cache with its launch flags",
        )
    if not run.get("eos_token_ids"):
        warn(
            "eos_unknown",
            "EOS ids unknown (the engine does not report them and no tokenizer says them): `tracekit diff` "
            "cannot call a difference after EOS post_eos; pass --tokenizer DIR (the served model's)",
        )


def topk_width(toks) -> int:
    """The most top-k candidates any token of a row came with (ids, logprobs or logits known)."""
    known = (toks.topk_id >= 0) | ~np.isnan(toks.topk_logprob)
    if toks.topk_logit is not None:
        known |= ~np.isnan(toks.topk_logit)
    return int(known.sum(axis=1).max()) if len(toks) else 0


class Watch:
    """Pitfalls seen in the answers: `seen(spec, outcome)` for each finished request,
    `finish()` once the run has sent everything."""

    def __init__(self, warn, dialect: str, engine_kind: str, cache_field: str):
        self.warn, self.dialect, self.engine_kind, self.cache_field = warn, dialect, engine_kind, cache_field
        self.ok = 0
        self.cached_reported = False
        self.context_limited: list[int] = []  # output lengths of rows the engine cut at its context limit

    def seen(self, spec: RequestSpec, outcome) -> None:
        rec, toks = outcome.record, outcome.tokens
        if rec.status != "ok":
            return
        self.ok += 1
        self.cached_reported |= rec.cached_tokens >= 0
        if rec.finish_reason == CONTEXT_LIMIT:
            self.context_limited.append(len(toks) if toks is not None else -1)
        if self.ok == FIRST_ANSWERS:
            self._cached()
        k = spec.top_logprobs
        if toks is not None and len(toks) and k > 0 and (w := topk_width(toks)) < k:
            self.warn(
                "topk_capped",
                f"the engine returned at most {w} top-k candidates a token where {k} were asked: it caps "
                "top_logprobs (vLLM and TGI refuse more than --max-logprobs / --max-top-n-tokens instead); "
                f"a flip beyond the first {w} candidates has no evidence in the trace",
            )

    def finish(self) -> None:
        if 0 < self.ok < FIRST_ANSWERS:
            self._cached()
        if self.context_limited:
            n = self.context_limited
            self.warn(
                "context_truncated",
                f"{len(n)} of {self.ok} requests stopped at the engine's context limit before their max_tokens "
                f"(llama.cpp truncated: true, stop_type limit; after {min(n)}-{max(n)} tokens): prompt + output "
                "filled a slot's context (llama-server -c N is split over -np slots); the rows' finish reason is "
                "context_limit. Give the server more context (-c) or ask fewer tokens",
            )

    def _cached(self) -> None:
        if self.cached_reported:
            return
        if self.dialect == "vllm" and self.engine_kind != "tracekit":
            why = "vLLM sends usage.prompt_tokens_details.cached_tokens only with --enable-prompt-tokens-details"
        elif self.dialect == "tgi":
            why = "TGI does not report them"
        else:
            why = f"the engine sent no {self.cache_field}"
        self.warn(
            "no_cached_tokens",
            f"no per-request cached tokens ({why}): `tracekit diff` cannot tell a prefix-cache boundary from "
            "a bug (cache_boundary never applies); the run metadata's prefix_cache_counters hold the engine's "
            "/metrics counters where it has them",
        )
