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


@dataclass
class DiagnosticSummary:
    """What a run wrote. Mutable on purpose: run_diagnostic adds each dtype's rows and seconds."""

    path: str
    rows: int = 0
    sequences: int = 0
    skipped: list[str] = field(default_factory=list)  # "key history (why)": pairs that do not apply
    seconds_by_dtype: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "out": self.path,
            "rows": self.rows,
            "sequences": self.sequences,
            "skipped": list(self.skipped),
            "seconds_by_dtype": dict(self.seconds_by_dtype),
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
        )
