"""What each request asked for and how its stream ended, read from the trace.

A benign verdict compares two greedy streams, asked the same way, that each
ran to their end. This module reads, per request row, the request body capture
recorded (`params`, JSON; each engine dialect names its fields differently) and
the run's `sampling` defaults, and answers:

- was it sampled? temperature > 0 (a number or a numeric string), TGI's
  do_sample, or a recorded body that sets no temperature at all (OpenAI-style
  servers then sample: OpenAI and vLLM default to 1.0, llama.cpp to 0.8).
  top_k = 1 is greedy whatever the temperature. Such pairs are not comparable;
- did A and B ask for the same generation (penalties, logit bias, stop
  strings, top-p ...)? A flip caused by a different request is no numeric flip;
- how many tokens were asked, was EOS ignored, and was the stream truncated
  (no finish reason; fewer tokens than asked while EOS was ignored; "length"
  before max_tokens; an abort)? A stream the engine stopped at its context limit
  (`context_limit`, llama.cpp's `truncated: true`) ran to a proper end: the diff
  says so per pair and for the run (context_notes), never blames the pair.

Parsing runs once per distinct params string (a run usually has a handful).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

STOP_LIKE = {"stop", "eos", "eos_token", "stop_sequence"}
# The engine stopped the stream when prompt + output filled its context (capture's finish reason for
# llama.cpp's `truncated: true, stop_type: limit`): a proper end, the same for A and B on one engine.
CONTEXT_LIMIT = "context_limit"
LENGTH_LIKE = {"length", "max_tokens", "max_new_tokens"}
SCOPES = ("sampling_params", "parameters")  # SGLang and TGI nest their sampling fields

# Request fields that change which token a greedy engine picks, with their neutral
# value: A and B must agree on each (absent = neutral).
GENERATION = {
    "logit_bias": None,
    "repetition_penalty": 1.0,
    "repeat_penalty": 1.0,  # llama.cpp, llama-cpp-python
    "dry_multiplier": 0.0,  # llama.cpp DRY
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "stop": None,
    "stop_token_ids": None,
    "stop_sequences": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "min_tokens": 0,
    "response_format": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "grammar": None,
    "json_schema": None,
    "regex": None,
    "logits_processors": None,
    "use_beam_search": False,
    "best_of": None,
    "n": 1,
}


@dataclass(frozen=True)
class Asked:
    """Per request row: whether it was sampled ('' = greedy, else why), max_tokens
    (-1 unknown), ignore_eos (-1 unknown, 0, 1), whether stop strings / ids were
    sent, and the generation fields that differ from neutral (sorted (name, JSON))."""

    sampled: str = ""
    max_tokens: int = -1
    ignore_eos: int = -1
    has_stop: bool = False
    generation: tuple[tuple[str, str], ...] = ()


def _first(d: Mapping, *names: str) -> Any:
    for scope in (d, *(d.get(s) for s in SCOPES)):
        if isinstance(scope, Mapping):
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


def _num(x: Any) -> float:
    """A number, or a numeric string ("0.7": many servers accept it); NaN otherwise."""
    if isinstance(x, bool):
        return math.nan
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x.strip())
        except ValueError:
            return math.nan
    return math.nan


def _sampled(d: Mapping, run_s: Mapping, body: bool) -> str:
    top_k = _num(_first(d, "top_k"))
    if top_k == 1:
        return ""  # greedy whatever the temperature
    if _first(d, "do_sample") is True:
        return "do_sample true"
    raw = _first(d, "temperature")
    temp = _num(raw)
    if raw is not None and math.isnan(temp):
        return f"temperature {raw!r} (not a number)"
    if math.isnan(temp) and not body:
        temp = _num(run_s.get("temperature"))  # no body recorded: the run's setting
    if temp > 0:
        return f"temperature {temp:g}"
    if math.isnan(temp) and body and _first(d, "do_sample") is not False:
        return "no temperature (OpenAI-compatible servers then sample)"
    return ""


def _generation(d: Mapping) -> tuple[tuple[str, str], ...]:
    out = []
    for name, neutral in GENERATION.items():
        v = _first(d, name)
        if v is None or v == neutral or v in ([], {}, ""):
            continue
        out.append((name, json.dumps(v, sort_keys=True)))
    return tuple(out)


def parse_params(text: str, run_s: Mapping) -> Asked:
    """One request's body (as capture stored it) -> Asked; the run's `sampling`
    (RunRecord.sampling) fills what the body does not say (and stands in when no body was recorded)."""
    try:
        d = json.loads(text) if text else {}
    except json.JSONDecodeError:
        d = {}
    d = d if isinstance(d, dict) else {}
    mt = _num(_first(d, "max_tokens", "max_completion_tokens", "max_new_tokens", "n_predict"))
    if math.isnan(mt):
        mt = _num(run_s.get("max_tokens"))
    ie = _first(d, "ignore_eos")
    if ie is None:
        ie = run_s.get("ignore_eos")
    return Asked(
        sampled=_sampled(d, run_s, bool(d)),
        max_tokens=int(mt) if math.isfinite(mt) and mt > 0 else -1,
        ignore_eos=-1 if not isinstance(ie, bool) else int(ie),
        has_stop=bool(_first(d, "stop", "stop_token_ids", "stop_sequences")),
        generation=_generation(d),
    )


def asked(side, rows: np.ndarray) -> list[Asked]:
    """Asked for each row in `rows` (-1 = missing row: Asked()). Teacher-forced rows
    replay a sequence greedily: nothing was sampled."""
    cache: dict[str, Asked] = {}
    params = side.table.params
    tf = side.meta.source == "teacher_forced"
    out = []
    for r in rows.tolist():
        if r < 0 or tf:
            out.append(Asked())
            continue
        text = params[r]
        if text not in cache:
            cache[text] = parse_params(text, side.meta.record.sampling)
        out.append(cache[text])
    return out


def sampled_reason(a: Asked, b: Asked) -> str:
    """'' when both requests were greedy, else why the pair is incomparable."""
    hot = [(name, x.sampled) for name, x in (("A", a), ("B", b)) if x.sampled]
    if not hot:
        return ""
    said = " and ".join(f"{n}'s request has {why}" for n, why in hot)
    return f"sampled: {said}; sampled streams are not comparable token by token"


def requests_differ(a: Asked, b: Asked) -> str:
    """'' when A and B asked for the same generation, else which fields differ."""
    da, db = dict(a.generation), dict(b.generation)
    names = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
    if not names:
        return ""
    parts = [f"{n} {da.get(n, '-')} vs {db.get(n, '-')}" for n in names]
    return f"requests differ: {'; '.join(parts)} (A vs B): a flip can be the request, not numerics"


def truncation(side, row: int, n: int, ask: Asked) -> str:
    """Why this side's stream counts as cut short ('' = it ran to a proper end).
    Teacher-forced rows replay a given sequence: never truncated."""
    if row < 0 or side.meta.source == "teacher_forced":
        return ""
    fin = str(side.table.finish_reason[row]).strip().lower()
    if not fin:
        return f"ended after {n} tokens without a finish reason"
    short = 0 <= n < ask.max_tokens
    asked_n = f"{n} of {ask.max_tokens} tokens asked"
    if fin in STOP_LIKE:
        if short and ask.ignore_eos == 1 and not ask.has_stop:
            return f"stopped ({fin}) after {asked_n} although EOS was ignored and no stop string was sent"
        return ""
    if fin in LENGTH_LIKE:
        return f"finish_reason {fin} after {asked_n}" if short else ""
    if fin == CONTEXT_LIMIT:
        return ""  # the engine's context limit: said by context_limited(), never blamed on the pair
    return f"finish_reason {fin!r} after {n} tokens"


def complete(side, rows: np.ndarray, n: np.ndarray, asked: Sequence[Asked]) -> np.ndarray:
    """[P] bool for rows [P] of a side: where truncation() is surely '' (a missing row, a
    teacher-forced side, a stop, a length stop at max_tokens, the context limit), decided for
    all pairs at once; truncation() words the rest (tests/analyze/test_vectorised.py: the same)."""
    if side.meta.source == "teacher_forced":
        return np.ones(len(rows), bool)
    has = rows >= 0
    fin_raw = side.table.finish_reason[np.maximum(rows, 0)] if len(side.table) else np.full(len(rows), "")
    uniq, inv = np.unique(fin_raw.astype(str), return_inverse=True)
    fin = np.array([str(u).strip().lower() for u in uniq.tolist()], dtype=object)[inv.reshape(-1)]
    mx = np.array([a.max_tokens for a in asked], dtype=np.int64)
    ignore = np.array([a.ignore_eos for a in asked], dtype=np.int64)
    stop = np.array([a.has_stop for a in asked], dtype=bool)
    short = (n >= 0) & (n < mx)
    stop_like, length_like = np.isin(fin, list(STOP_LIKE)), np.isin(fin, list(LENGTH_LIKE))
    ok = (stop_like & ~(short & (ignore == 1) & ~stop)) | (length_like & ~short) | (fin == CONTEXT_LIMIT)
    return ~has | (ok & (fin != ""))


def context_limited(side, row: int) -> bool:
    """The engine stopped this row at its context limit (prompt + output = a slot's context)."""
    return row >= 0 and str(side.table.finish_reason[row]).strip().lower() == CONTEXT_LIMIT


def _at_context_limit(side, rows: np.ndarray) -> np.ndarray:
    """[P] bool: context_limited() of each row of `rows` (-1: missing, False)."""
    if not len(side.table) or not len(rows):
        return np.zeros(len(rows), bool)
    uniq, inv = np.unique(side.table.finish_reason[np.maximum(rows, 0)].astype(str), return_inverse=True)
    hit = np.array([str(u).strip().lower() == CONTEXT_LIMIT for u in uniq.tolist()], dtype=bool)
    return (rows >= 0) & hit[inv.reshape(-1)]


def context_notes(al) -> tuple[list[str], list[str]]:
    """(a note per pair, '' for most; the diff's run-level lines) for streams the engine stopped at
    its context limit: both sides (compared up to there, like max_tokens), or one side only."""
    per = [""] * len(al.keys)
    both, one = [], []
    lim_a, lim_b = _at_context_limit(al.a, al.row_a), _at_context_limit(al.b, al.row_b)
    for i in np.flatnonzero(lim_a | lim_b).tolist():  # (context_limited() of each pair, at once)
        ca, cb = bool(lim_a[i]), bool(lim_b[i])
        if ca and cb:
            per[i] = f"both truncated by the engine's context limit (A after {al.n_a[i]}, B after {al.n_b[i]} tokens)"
            both.append((int(al.n_a[i]), int(al.n_b[i])))
        elif ca or cb:
            side, n, other = ("A", al.n_a[i], al.n_b[i]) if ca else ("B", al.n_b[i], al.n_a[i])
            per[i] = f"{side} truncated by the engine's context limit after {n} tokens, the other side ran {other}"
            one.append(i)
    lines = []
    if both:
        lo, hi = min(min(x) for x in both), max(max(x) for x in both)
        lines.append(
            f"{len(both)} pair(s) both truncated by the engine's context limit (after {lo}-{hi} tokens; llama.cpp "
            "truncated: true): compared up to there, not blamed on the pair; give the engine more context to "
            "compare the tokens asked"
        )
    if one:
        lines.append(
            f"{len(one)} pair(s) with one side truncated by the engine's context limit: the engines' contexts differ"
        )
    return per, lines
