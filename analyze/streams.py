"""What each request asked for and how its stream ended, read from the trace.

A benign verdict compares two greedy streams that each ran to their end. This
module reads, per request row, the request body capture recorded (`params`,
JSON; each engine dialect names its fields differently) and the run's
`sampling` defaults, and answers three questions:

- was it sampled? (temperature > 0, or TGI's do_sample): such a pair is not
  comparable token by token;
- how many tokens were asked, and was EOS ignored?
- was the stream truncated? (no finish reason; fewer tokens than asked while
  EOS was ignored; finish_reason "length" before max_tokens; an abort).

Parsing runs once per distinct params string (a run usually has a handful).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

STOP_LIKE = {"stop", "eos", "eos_token", "stop_sequence"}
LENGTH_LIKE = {"length", "max_tokens", "max_new_tokens"}


@dataclass(frozen=True)
class Asked:
    """Per request row: temperature (NaN unknown), max_tokens (-1 unknown),
    ignore_eos (-1 unknown, 0, 1), whether stop strings / ids were sent."""

    temperature: float = math.nan
    max_tokens: int = -1
    ignore_eos: int = -1
    has_stop: bool = False


def _first(d: Mapping, *names: str) -> Any:
    for scope in (d, d.get("sampling_params"), d.get("parameters")):
        if isinstance(scope, Mapping):
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def parse_params(text: str, run: Mapping) -> Asked:
    """One request's body (as capture stored it) -> Asked; the run's `sampling`
    block fills what the body does not say."""
    try:
        d = json.loads(text) if text else {}
    except json.JSONDecodeError:
        d = {}
    d = d if isinstance(d, dict) else {}
    run_s = run.get("sampling") if isinstance(run.get("sampling"), Mapping) else {}
    temp = _num(_first(d, "temperature"))
    if math.isnan(temp):
        temp = _num(run_s.get("temperature"))
    if _first(d, "do_sample") is True:  # TGI: greedy is do_sample false
        temp = temp if temp > 0 else 1.0
    mt = _num(_first(d, "max_tokens", "max_completion_tokens", "max_new_tokens", "n_predict"))
    if math.isnan(mt):
        mt = _num(run_s.get("max_tokens"))
    ie = _first(d, "ignore_eos")
    if ie is None:
        ie = run_s.get("ignore_eos")
    stop = _first(d, "stop", "stop_token_ids", "stop_sequences")
    return Asked(
        temperature=temp,
        max_tokens=int(mt) if math.isfinite(mt) and mt > 0 else -1,
        ignore_eos=-1 if not isinstance(ie, bool) else int(ie),
        has_stop=bool(stop),
    )


def asked(side, rows: np.ndarray) -> list[Asked]:
    """Asked for each row in `rows` (-1 = missing row: Asked())."""
    cache: dict[str, Asked] = {}
    params = side.table.params
    out = []
    for r in rows.tolist():
        if r < 0:
            out.append(Asked())
            continue
        text = params[r]
        if text not in cache:
            cache[text] = parse_params(text, side.meta.run)
        out.append(cache[text])
    return out


def sampled_reason(a: Asked, b: Asked) -> str:
    """'' when both requests were greedy (or say nothing), else why the pair is incomparable."""
    hot = [(name, x.temperature) for name, x in (("A", a), ("B", b)) if x.temperature > 0]
    if not hot:
        return ""
    said = " and ".join(f"{n}'s request has temperature {t:g}" for n, t in hot)
    return f"sampled: {said}; sampled streams are not comparable token by token"


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
    return f"finish_reason {fin!r} after {n} tokens"
