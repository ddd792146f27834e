"""Are two teacher-forced traces' rows bitwise equal? (e.g. TP=2 with nccl on two GPUs vs gloo on one)

    PYTHONPATH=. python bench/gpu_study/tp_compare.py A.h5 B.h5 [A2.h5 B2.h5 ...]

Rows pair by (key, history, dtype); equal means the same token ids, top-k ids, top-k logits and
chosen logprobs, bit for bit (NaN equal to NaN). Prints one line per pair of files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tracekit.store import TraceReader  # noqa: E402


def rows(path: str) -> dict:
    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            c = r.tokens(i)
            out[(t.key[i], t.history[i], t.dtype[i])] = (c.token_id, c.topk_id, c.topk_logit, c.logprob)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print("usage: tp_compare.py A.h5 B.h5 [A2.h5 B2.h5 ...]", file=sys.stderr)
        return 2
    for a, b in zip(argv[::2], argv[1::2]):
        ra, rb = rows(a), rows(b)
        both = [k for k in ra if k in rb]
        eq = {k: all(np.array_equal(x, y, equal_nan=True) for x, y in zip(ra[k], rb[k])) for k in both}
        worst = max((float(np.nanmax(np.abs(ra[k][2].astype(np.float64) - rb[k][2]))) for k in both), default=0.0)
        by: dict[str, list[int]] = {}
        for k, v in eq.items():
            by.setdefault(k[2], [0, 0])
            by[k[2]][0] += v
            by[k[2]][1] += 1
        print(
            f"{a} vs {b}: {sum(eq.values())}/{len(eq)} rows bitwise equal ({len(ra)} and {len(rb)} rows); "
            f"by dtype {by}; max |dlogit| over top-k {worst:.3g}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
