"""Teacher-forced cache-history diagnostic: replay a request's exact tokens
through an HF causal LM under several KV-cache histories and dtypes, and write
the logits in the trace format (source "teacher_forced").

`run_teacher(TeacherConfig(...))` (run.py) is what `tracekit capture --teacher-forced
MODEL_DIR` calls (the CLI builds the config and prints the summary; this package writes
only progress, on stderr). The library entry points are `run_diagnostic` (sequences ->
trace file) and `trie.run_histories` (one batch -> logits). `--tp N` is tp.py (the
launcher, in the calling process) and tp_rank.py (inside each rank). torch is imported lazily.
"""

from __future__ import annotations

from .config import TeacherConfig
from .diagnostic import DiagnosticConfig, run_diagnostic
from .history import History, HistorySpec, parse_dtypes, parse_histories
from .records import DiagnosticSummary, LoadedModel, Rank
from .run import run_teacher
from .sequences import TokenSequence, from_trace

__all__ = [
    "DiagnosticConfig",
    "DiagnosticSummary",
    "History",
    "HistorySpec",
    "LoadedModel",
    "Rank",
    "TeacherConfig",
    "TokenSequence",
    "from_trace",
    "parse_dtypes",
    "parse_histories",
    "run_diagnostic",
    "run_teacher",
]
