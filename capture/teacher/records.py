"""The records the diagnostic's modules hand each other: this process's TP rank, a loaded model,
and the run's summary.

They live here, below every module that uses them, so that the launcher (tp.py), the code that
runs inside a rank (tp_rank.py) and the diagnostic itself (model.py, trie.py, diagnostic.py) can
all import them without importing each other. Nothing here imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rank:
    """One process of a `--tp N` run, as the launcher started it. A run without --tp has no Rank
    (None wherever one is passed)."""

    index: int  # 0 .. world-1; rank 0 writes the trace
    world: int  # the tensor-parallel size N
    backend: str  # gloo | nccl
    devices: tuple[str, ...]  # every rank's device, by index: "cpu" or "cuda:K"

    @property
    def device(self) -> str:
        return self.devices[self.index]

    @property
    def writes_trace(self) -> bool:
        """Every rank computes every row (each forward's collectives need all of them); one writes."""
        return self.index == 0

    def as_dict(self) -> dict:
        """The JSON the launcher hands a rank (from_dict reads it back there)."""
        return {"index": self.index, "world": self.world, "backend": self.backend, "devices": list(self.devices)}

    @classmethod
    def from_dict(cls, d: dict) -> Rank:
        return cls(int(d["index"]), int(d["world"]), str(d["backend"]), tuple(d["devices"]))


@dataclass
class LoadedModel:
    """A model ready for teacher-forced forwards (eval mode, on its device)."""

    model: Any
    dtype: str
    device: str
    cache_kw: str  # forward keyword for the KV cache: 'cache' (5.2x) or 'past_key_values'
    vocab_size: int
    cuda_graphs: bool = True  # decode chains on CUDA as graphs with eager attention (graphs.py)
    reuse_prefixes: bool = True  # cut root segments from a longer one where verified bitwise (reuse.py)
    # reuse.py's verdicts: shape key -> whether the cut equals the separate forward, bit for bit.
    # One dict per loaded model, shared by dataclasses.replace copies of this record.
    prefix_verdicts: dict = field(default_factory=dict)


@dataclass
class DiagnosticSummary:
    """What a run wrote. Mutable on purpose: run_diagnostic adds each dtype's rows and seconds."""

    path: str
    rows: int = 0
    sequences: int = 0
    skipped: list[str] = field(default_factory=list)  # "key history (why)": pairs that do not apply
    seconds_by_dtype: dict[str, float] = field(default_factory=dict)
    # reuse.py's counts over the run: first segments cut from a longer one (reused), shapes compared
    # (verified), comparisons that found a difference (failed; those shapes ran their own forwards)
    prefix_segments: dict[str, int] = field(default_factory=lambda: {"reused": 0, "verified": 0, "failed": 0})

    def as_dict(self) -> dict:
        return {
            "out": self.path,
            "rows": self.rows,
            "sequences": self.sequences,
            "skipped": list(self.skipped),
            "seconds_by_dtype": dict(self.seconds_by_dtype),
            "prefix_segments": dict(self.prefix_segments),
        }

    @classmethod
    def from_dict(cls, d: dict) -> DiagnosticSummary:
        """The inverse of as_dict (rank 0's summary, read back by the launcher)."""
        return cls(
            path=d["out"],
            rows=d["rows"],
            sequences=d["sequences"],
            skipped=d["skipped"],
            seconds_by_dtype=d["seconds_by_dtype"],
            prefix_segments=d.get("prefix_segments", {"reused": 0, "verified": 0, "failed": 0}),
        )
