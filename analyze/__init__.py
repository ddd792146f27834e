"""Analysis of tracekit traces: align two runs by request key, classify every
divergence (docs/analysis.md), and report it.

    >>> from analyze import diff
    >>> r = diff("serial.h5", "concurrent.h5")
    >>> r.counts()["unexplained"], r.ok

This package never imports torch, aiohttp or capture/.
"""

from .classify import CLASSES, Thresholds
from .compare import diff
from .grid import steps
from .result import SCHEMA, DiffResult, PairResult
from .testing import assert_equivalent

__all__ = ["CLASSES", "SCHEMA", "DiffResult", "PairResult", "Thresholds", "assert_equivalent", "diff", "steps"]
