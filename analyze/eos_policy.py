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

So a llama.cpp stream that ran with ignore_eos and, where the model ranks an EOS first, took its
best non-EOS token is no bug: `skipped_eos` checks that claim part by part (docs/analysis.md,
"post_eos") and classify.py calls such a pair post_eos. Reads run metadata, the classified pairs
and the top-k rows at their first differences only; never the engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.runrecord import record_of

from .checks import greedy_ok
from .evidence import GREEDY_NATS

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
    rec = record_of(meta)
    if rec.engine_family:
        return rec.engine_family
    owned = rec.engine.owned_by
    if owned == "llamacpp" or rec.engine.answered("props"):
        return "llamacpp"
    if rec.engine.answered("info"):
        return "tgi"
    return owned if owned in POLICY else rec.dialect


def _ignored_eos(meta) -> bool:
    asked = record_of(meta).sampling_ignore_eos
    return asked is True or (isinstance(asked, list) and True in asked)


def _side(fam: str, ignored: bool) -> tuple[str, str, str | None]:
    """(name, what it does at an EOS, 'emits' / 'skips' / 'stops' / None when unknown)."""
    name, does, at_eos = POLICY.get(fam, (fam, "what its ignore_eos does is not known here", None))
    if not ignored:
        return name, "EOS not ignored: it stops at the first EOS", "stops"
    return name, does, at_eos


_MEANS = {
    frozenset({"emits", "skips"}): (
        "Where the model ranks an EOS first, one side emits it and the other its best non-EOS token: the pair "
        "parts at that EOS itself, and is post_eos when each part of that is checked (the EOS is a known id, "
        "llama.cpp's side ran with ignore_eos and ranks that EOS first there too, its token is its best "
        "non-EOS candidate, drift before it within tolerance, both streams complete), else unexplained; "
        "every later position follows different tokens and is not compared."
    ),
    frozenset({"emits", "stops"}): (
        "Where the model ranks an EOS first, both take it, but one stream ends there: positions after it "
        "exist on one side only."
    ),
    frozenset({"skips", "stops"}): (
        "Where the model ranks an EOS first, one stream ends with it and the other takes its best non-EOS "
        "token: post_eos when that is checked as above and the stream that ended was not asked to ignore "
        "EOS (one that was counts as cut short: unexplained)."
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


# -- the benign verdict: llama.cpp skipped an EOS the other side emitted ------------------------

SKIPS = "llamacpp"  # the family whose ignore_eos takes the best non-EOS token (POLICY: "skips")


@dataclass(frozen=True)
class Skipped:
    """Per pair [P]: where the rule fires, what happened (`head`, '' elsewhere) and the side that
    skipped the EOS (`by`: 'A' / 'B'); where a side emitted a known EOS at the first difference
    but the rule does not fire, why (`why_not`)."""

    head: np.ndarray
    by: np.ndarray
    why_not: np.ndarray


def _best_other(ids: np.ndarray, lps: np.ndarray, lg: np.ndarray | None, eos_ids: np.ndarray):
    """[D] the top-1 of each row once every known EOS id is removed, by logprob and by logit:
    (id, logprob, id, logit); id -1 and value -inf / NaN when there is none (logit: no logits).
    ids/lps/lg [D, k]."""
    D, k = ids.shape
    keep = (ids >= 0) & ~np.isin(ids, eos_ids)
    r = np.arange(D)
    out = []
    for x in (lps, lg):
        if x is None or not k or not np.isfinite(x).any():
            out += [np.full(D, -1, np.int64), np.full(D, np.nan if x is lg else -np.inf)]
            continue
        v = np.where(keep & ~np.isnan(x), x.astype(np.float64), -np.inf)
        j = v.argmax(1)
        best = v[r, j]
        out += [np.where(np.isneginf(best), -1, ids[r, j]).astype(np.int64), best]
    return tuple(out)


def _name(fam: str | None) -> str:
    return POLICY[fam][0] if fam in POLICY else f"of family {fam!r}" if fam else "of unknown family"


def skipped_eos(al, t, tokens, eos_ids, D, rows, tops, f, checked) -> Skipped:
    """The rule, per pair: at the first difference t side S emitted one of the known EOS ids
    (A's, as post_eos uses them) and side L, a llama.cpp stream whose request asked ignore_eos,
    ranks that same EOS first (by logprob, and by logit where it has logits) and chose its best
    non-EOS candidate (its top-1 once every known EOS id is removed); S chose its own top-1,
    went on past it only where its request ignored EOS, and is no llama.cpp with ignore_eos
    itself; and `checked` ([P]: both rows sane, logits and logprobs agree, both candidates
    moved within the drift tolerance, drift before t within tolerance, both streams complete).

    al: Alignment; t [P]; tokens (token_a, token_b) [P]; D [D] the pairs differing at t; rows
    (SideRow A, SideRow B) and tops ((ids, lps, logits) A, B) at D; f: facts.Facts [P]."""

    P = len(al.keys)
    out = Skipped(np.full(P, "", object), np.full(P, "", object), np.full(P, "", object))
    eos_ids = np.asarray(eos_ids, dtype=np.int64)
    if not len(D) or not len(eos_ids):
        return out
    fam = (family(al.a.meta), family(al.b.meta))
    sides = (f.a, f.b)
    asked, n = (al.asked_a, al.asked_b), (al.n_a, al.n_b)
    for s, o in ((0, 1), (1, 0)):  # S emitted the EOS, the other (L) may have skipped it
        S, L = "AB"[s], "AB"[o]
        greedy = greedy_ok(f, sides[s])
        tok_s, tok_l = tokens[s][D], tokens[o][D]
        emitted = np.isin(tok_s, eos_ids)
        if not emitted.any():
            continue
        row = rows[o]
        id_lp, best_lp, id_lg, best_lg = _best_other(*tops[o], eos_ids)
        top_eos = (row.top1 == tok_s) & (row.top1_lp == tok_s)
        by_lp = row.lp_mine >= best_lp - GREEDY_NATS * np.maximum(1, np.abs(best_lp))
        by_lg = np.isnan(best_lg) | (row.lg_mine >= best_lg)  # a row without logits: by logprob only
        best = row.has_mine & ~np.isin(tok_l, eos_ids) & by_lp & by_lg
        for j in np.flatnonzero(emitted).tolist():
            i, e, at = int(D[j]), int(tok_s[j]), int(t[D[j]])
            ask_s, ask_l = asked[s][i], asked[o][i]
            why = []
            if fam[o] != SKIPS:
                why.append(f"{L} is {_name(fam[o])}, not llama.cpp (only llama.cpp's ignore_eos skips an EOS)")
            if ask_l.ignore_eos != 1:
                said = "did not ask" if ask_l.ignore_eos == 0 else "does not say it asked"
                why.append(f"{L}'s request {said} ignore_eos")
            if not top_eos[j]:
                lp_said = f" (by logprob {int(row.top1_lp[j])})" if row.top1_lp[j] != row.top1[j] else ""
                why.append(f"{L}'s own top-1 at {at} is {int(row.top1[j])}{lp_said}, not the EOS {e}")
            if not best[j]:
                other = int(id_lp[j]) if not by_lp[j] or by_lg[j] else int(id_lg[j])
                why.append(f"{L}'s token {int(tok_l[j])} is not its best non-EOS candidate ({other})")
            if not greedy[i]:
                why.append(f"{S}'s EOS {e} is not its own top-1 ({int(sides[s].top1[i])})")
            if n[s][i] > at + 1 and ask_s.ignore_eos == 0:
                why.append(f"{S} went on past its EOS at {at} although its request did not ignore EOS")
            if fam[s] == SKIPS and ask_s.ignore_eos == 1:
                why.append(f"{S} is llama.cpp with ignore_eos, which never emits an EOS")
            if not why and checked[i]:
                out.head[i] = (
                    f"{S} emitted EOS {e} at {at}; {L} (llama.cpp, ignore_eos) ranks EOS {e} first there too "
                    "and took its best non-EOS token, as its sampler's EOS bias does"
                )
                out.by[i] = L
                continue
            said = "; ".join(why) or "the checks above fail"
            prev = out.why_not[i]
            out.why_not[i] = (prev + "; " if prev else "") + (
                f"{S} emitted EOS {e} at {at}, {L} did not: not the ignore_eos difference ({said})"
            )
    out.why_not[out.head != ""] = ""
    return out
