"""What `ignore_eos` does in each engine family, and the one note `tracekit diff` prints when A and
B come from different families and either ran with it.

Engines implement ignore_eos differently, so two engines that both "ignore EOS" still part at the
first position where the model ranks an EOS first. Read in the engines' own source (docs/engines.md
cites file and commit):

- vLLM 0.33.0 (vllm/sampling_params.py update_from_generation_config, vllm/v1/core/sched/utils.py
  check_stop): the EOS id, and the extra EOS ids of generation_config, no longer stop the request;
  the choice is untouched, so an EOS is emitted where it ranks first and generation goes on. The
  request's own `stop_token_ids` and `stop` strings still stop it.
- SGLang 0.5.23 (sglang/srt/managers/schedule_batch.py _check_token_based_finish): no token stops
  the request, the request's `stop_token_ids` included; an EOS is emitted where it ranks first.
- llama.cpp 0c1e570 (common/common.cpp logit_bias_eog, tools/server/server-schema.cpp ignore_eos,
  server-common.cpp get_token_probabilities): a -inf logit bias on every end-of-generation token in
  the sampler, so an EOS is never emitted; where it ranks first the best other token is. The
  logprobs it reports are taken before the sampler: the EOS still ranks first in its top-k there.
- TGI v3.3.7 (router/src/validation.rs: ignore_eos_token false for every request): no switch; it
  stops at the first EOS whatever the capture asked.
- tracekit serve (tracekit/engine/engine.py): as vLLM, without stop_token_ids.

Reads run metadata and the classified pairs only; never the engines.
"""

from __future__ import annotations

import numpy as np

_GOES_ON = "an EOS that ranks first is emitted and generation goes on"
# family -> (name, what its ignore_eos does, what a greedy stream does at an EOS that ranks first:
# "emits" it and goes on, "skips" it for the next token, "stops" there)
POLICY = {
    "vllm": ("vLLM", f"{_GOES_ON} (the request's stop_token_ids still stop it)", "emits"),
    "sglang": ("SGLang", f"{_GOES_ON} (no token stops it)", "emits"),
    "tracekit": ("tracekit serve", _GOES_ON, "emits"),
    "llamacpp": (
        "llama.cpp",
        "a -inf bias in its sampler: an EOS is never emitted, the best other token is, while its "
        "logprobs (taken before the sampler) still rank the EOS first",
        "skips",
    ),
    "tgi": ("TGI", "no ignore_eos switch: it stops at the first EOS", "stops"),
}


def family(meta) -> str | None:
    """The engine family of an HTTP trace: the run metadata's `engine_family`, else (traces written
    before it was recorded) the engine's self-report; None for teacher-forced traces."""
    if meta.source != "http":
        return None
    run = meta.run
    if run.get("engine_family"):
        return str(run["engine_family"])
    eng = run.get("engine") if isinstance(run.get("engine"), dict) else {}
    owned = str((eng.get("v1_models") or {}).get("owned_by", "")).lower()
    if owned == "llamacpp" or "props" in eng:
        return "llamacpp"
    if "info" in eng:
        return "tgi"
    return owned if owned in POLICY else (run.get("dialect") or None)


def _ignored_eos(meta) -> bool:
    asked = (meta.run.get("sampling") or {}).get("ignore_eos")
    return asked is True or (isinstance(asked, list) and True in asked)


def _side(fam: str, ignored: bool) -> tuple[str, str, str | None]:
    """(name, what it does at an EOS, 'emits' / 'skips' / 'stops' / None when unknown)."""
    name, does, at_eos = POLICY.get(fam, (fam, "what its ignore_eos does is not known here", None))
    if not ignored:
        return name, "EOS not ignored: it stops at the first EOS", "stops"
    return name, does, at_eos


_MEANS = {
    frozenset({"emits", "skips"}): (
        "Where the model ranks an EOS first, one side emits it and the other its runner-up: the pair parts "
        "at that EOS itself (post_eos needs an EOS in A before the difference) and the side that skipped "
        "the EOS did not take its own top-1, so the pair is unexplained although neither engine is at fault; "
        "every later position follows different tokens."
    ),
    frozenset({"emits", "stops"}): (
        "Where the model ranks an EOS first, both take it, but one stream ends there: positions after it "
        "exist on one side only."
    ),
    frozenset({"skips", "stops"}): (
        "Where the model ranks an EOS first, one stream ends with it and the other takes its runner-up: "
        "the pair parts at that EOS, and the side that skipped it did not take its own top-1 (unexplained)."
    ),
    frozenset({"emits"}): "Both emit an EOS that ranks first and go on; they part only where a request's own "
    "stop tokens do.",
}


def ignore_eos_note(meta_a, meta_b, cols: dict, eos_ids) -> str:
    """One note, or "" when A and B are one family, either is not an HTTP trace, or neither
    ignored EOS."""
    fa, fb = family(meta_a), family(meta_b)
    ia, ib = _ignored_eos(meta_a), _ignored_eos(meta_b)
    if not fa or not fb or fa == fb or not (ia or ib):
        return ""
    (na, wa, ea), (nb, wb, eb) = _side(fa, ia), _side(fb, ib)
    which = "both ran" if ia and ib else f"{'A' if ia else 'B'} ran"
    out = f"A is {na}, B is {nb}, {which} with ignore_eos, and the engines implement it differently: "
    out += f"{na}: {wa}; {nb}: {wb}. "
    out += _MEANS.get(frozenset({ea, eb}), "What follows an EOS may differ between the two for this reason alone.")
    if len(eos_ids) and len(cols.get("position", ())):
        ids = np.asarray(eos_ids, dtype=np.int64)
        at = np.asarray(cols["position"]) >= 0
        hit = at & (np.isin(cols["token_a"], ids) | np.isin(cols["token_b"], ids))
        out += f" {int(hit.sum())} of {len(at)} pair(s) first differ where one side emitted an EOS."
    return out + " To compare the engines themselves, capture both with --no-ignore-eos."
