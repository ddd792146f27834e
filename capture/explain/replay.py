"""The teacher-forced side of `tracekit explain`: replay each target's exact tokens
outside the engine (tracekit.capture.teacher's public API) under the histories that matter.

Each target becomes one `TokenSequence`: its prompt ids plus A's generated ids
up to and including the first differing position t, so the last scored
position is t (A and B agree before t, so the replay sees B's prefix too).
Histories: `full` (no cache: the reference), `decode` (prefill, then one
token a step, as serving does), and `prefix:b` for B's and A's reused-prefix
boundaries, each in every asked dtype. Each target is replayed under its own
boundaries only (one run serves all targets; targets with the same boundaries
and lengths share batches): 2 pairs with boundaries {32} and {16, 48} write
3 + 4 rows a dtype, not 5 + 5 (every pair's boundaries for every pair, before).
A boundary of 0 or unknown has no prefix history: that side's replay is `full`
(said in the report).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.schema import prompt_hash

from ..teacher import DiagnosticConfig, DiagnosticSummary, HistorySpec, TokenSequence, run_diagnostic
from .plan import Target


@dataclass(frozen=True)
class ReplayConfig:
    model_dir: str
    out: str
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    device: str = "cpu"
    top_logprobs: int = 5


def sequences(targets: list[Target]) -> list[TokenSequence]:
    return [
        TokenSequence(
            key=t.key,
            prompt_ids=np.asarray(t.prompt, np.int64),
            gen_ids=np.asarray(t.a_tokens, np.int64),
            prompt_hash=prompt_hash(list(t.prompt)),
            cached_tokens=-1,
        )
        for t in targets
    ]


def histories(targets: list[Target]) -> tuple[HistorySpec, ...]:
    """Every history some target is replayed under (the run metadata's list)."""
    bounds = sorted({b for t in targets for b in (t.boundary_b, t.boundary_a) if b > 0})
    return (HistorySpec("full"), HistorySpec("decode")) + tuple(HistorySpec("prefix", b) for b in bounds)


def histories_of(t: Target) -> tuple[HistorySpec, ...]:
    """One target's histories: full, decode and a prefix at each of its own boundaries."""
    return histories([t])


def replay(cfg: ReplayConfig, targets: list[Target]) -> DiagnosticSummary:
    """Write the teacher-forced rows of every target to cfg.out."""
    dcfg = DiagnosticConfig(
        model_dir=cfg.model_dir,
        histories=histories(targets),
        histories_by_key={t.key: histories_of(t) for t in targets},
        dtypes=tuple(cfg.dtypes),
        device=cfg.device,
        topk=cfg.top_logprobs,
    )
    return run_diagnostic(dcfg, sequences(targets), cfg.out, extra_run={"explain": [t.key for t in targets]})


def engine_histories(t: Target):
    """The engine-side replay's histories of one target: cold, and warm at A's and at B's
    boundary (each > 0 and inside the prompt)."""
    from ..replay_http import ReplayHistory

    bounds = sorted({b for b in (t.boundary_a, t.boundary_b) if 0 < b < len(t.prompt)})
    return (ReplayHistory("cold"), *(ReplayHistory("warm", b) for b in bounds))


def engine_replay(url: str, out: str, targets: list[Target], run: dict, top_logprobs: int = 5,
                  timeout_s: float = 600.0, api_key: str | None = None):  # fmt: skip
    """The engine's own teacher-forced replay of every target (A's tokens up to t) on `url`: cold
    and warm at A's and B's boundaries (capture/replay_http.py), proven by the engine's report;
    rows `engine:cold` / `engine:warm:B`. run: the fields of B's run metadata to keep (dtype ...)."""
    from ..replay_http import ReplayHttpConfig, replay_sequences

    cfg = ReplayHttpConfig(
        url=url,
        source="explain",
        out=out,
        histories=(),
        top_logprobs=top_logprobs,
        timeout_s=timeout_s,
        api_key=api_key,
        histories_by_key={t.key: engine_histories(t) for t in targets},
    )
    return replay_sequences(cfg, sequences(targets), run)
