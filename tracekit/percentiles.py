"""Summary statistics shared by the capture summary and the reports."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentiles(x: Iterable[float], qs: Iterable[float] = (50, 90, 99), ndigits: int = 6) -> dict[str, float]:
    """{"p50": ..., ...} over the finite values of x; {} when there are none."""
    a = np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if not len(a):
        return {}
    return {f"p{q:g}": round(float(np.percentile(a, q)), ndigits) for q in qs}
