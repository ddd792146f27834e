"""What `tracekit explain` replays for one divergent pair: a `Target`.

A target holds what the variants need from the two traces: the prompt token
ids, the first differing position t and both tokens there, each side's
reused-prefix boundary, A's tokens before t (the teacher-forced replay), the
sampling flags, and B's batch mates: the keys whose requests were in flight in
B while this key was generating up to t (from B's timestamps), each with its
prompt and its own boundary in B. Which keys diverge and where comes from the
caller (the CLI runs `tracekit.analyze.diff`; capture never imports analyze).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.errors import ConfigError
from tracekit.store import TraceReader


@dataclass(frozen=True)
class Mate:
    key: str
    prompt: tuple[int, ...]
    boundary: int  # its cached_tokens in B (-1 unknown)
    max_tokens: int  # its output length in B


@dataclass(frozen=True)
class Target:
    key: str
    prompt: tuple[int, ...]  # prompt token ids (A's and B's are equal for a comparable pair)
    position: int  # first differing generated position t (0-based)
    token_a: int
    token_b: int
    boundary_a: int  # reused prefix in A (-1 unknown)
    boundary_b: int
    a_tokens: tuple[int, ...]  # A's generated ids [0, t]: the replayed sequence ends at t
    mates: tuple[Mate, ...]  # B's batch mates
    ignore_eos: bool = True
    order: tuple[int, ...] = ()  # rank of the target, then of each mate, by send time in B

    @property
    def max_tokens(self) -> int:
        """Enough tokens to see position t."""
        return self.position + 1


def _row(reader: TraceReader, key: str) -> int:
    rows = reader.requests.index_by_key()
    if key not in rows:
        raise ConfigError(f"{reader.path}: no request with key {key!r}")
    return rows[key]


def batch_mates(reader: TraceReader, key: str, position: int) -> list[int]:
    """Rows of B in flight while `key` generated tokens 0..position: requests whose
    [sent, done] interval overlaps [sent, arrival of token `position`] of the key."""
    t = reader.requests
    i = _row(reader, key)
    arrivals = reader.tokens(i).t_arrival_s
    start = float(t.t_sent_s[i])
    end = float(arrivals[position]) if len(arrivals) > position and np.isfinite(arrivals[position]) else t.t_done_s[i]
    if not (np.isfinite(start) and np.isfinite(end)):
        return []
    overlap = (t.t_sent_s <= end) & (t.t_done_s >= start) & (t.status == "ok")
    overlap[i] = False
    # A resumed trace can hold a key twice: keep each key's last row only.
    last = t.index_by_key()
    return [j for j in np.flatnonzero(overlap).tolist() if last.get(t.key[j]) == j]


def _prompt(reader: TraceReader, i: int) -> tuple[int, ...]:
    ids = reader.prompt_ids(i)
    if ids is None or not len(ids):
        raise ConfigError(
            f"{reader.path}: request {reader.requests.key[i]!r} has no prompt token ids; explain replays "
            "token ids (capture with an engine that returns them, e.g. vLLM's return_token_ids)"
        )
    return tuple(int(x) for x in ids)


def plan_targets(a_path: str, b_path: str, pairs: list[dict]) -> list[Target]:
    """Targets of `pairs` ({key, position, token_a, token_b}, as `tracekit diff --json` writes them)."""
    out = []
    with TraceReader(a_path) as ra, TraceReader(b_path) as rb:
        ignore_eos = bool(rb.meta.record.sampling.get("ignore_eos", False))
        for p in pairs:
            key, t = p["key"], int(p["position"])
            ia, ib = _row(ra, key), _row(rb, key)
            rows = batch_mates(rb, key, t)
            mates = tuple(
                Mate(
                    rb.requests.key[j], _prompt(rb, j), int(rb.requests.cached_tokens[j]), int(rb.requests.n_tokens[j])
                )
                for j in rows
            )
            sent = [float(rb.requests.t_sent_s[j]) for j in [ib, *rows]]
            order = tuple(int(x) for x in np.argsort(np.argsort(sent, kind="stable"), kind="stable"))
            out.append(
                Target(
                    key=key,
                    prompt=_prompt(rb, ib),
                    position=t,
                    token_a=int(p["token_a"]),
                    token_b=int(p["token_b"]),
                    boundary_a=int(ra.requests.cached_tokens[ia]),
                    boundary_b=int(rb.requests.cached_tokens[ib]),
                    a_tokens=tuple(int(x) for x in ra.tokens(ia).token_id[: t + 1]),
                    mates=mates,
                    ignore_eos=ignore_eos,
                    order=order,
                )
            )
    return out
