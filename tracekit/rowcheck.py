"""The row checks of what an engine reported on a top-k row: one home for them and their limits.

Per token row of a trace's [N, k] top-k columns (ids and logprobs, rank order):

  pick      the chosen token's own entry in its row (NaN when absent)
  flags     disorder: an entry above the one before it by more than ORDER_TOL, or a value after
            a NaN; positive: the chosen logprob or a top-k logprob above POSITIVE_LIMIT; heavy:
            the row's probabilities (NaN entries left out) summing to more than SUM_LIMIT

Each check runs on a block (CACHE_BYTES: 1 MiB) as whole-block vector passes: the comparisons on the
flat block, the per-row "any" as ORs of the row's bytes read as wide ints, the mass as a
matrix-vector product; a reduction across each short row would cost numpy a call per row
(bench/diff_bench.py). The mass is summed in float32 and every row within 1e-3 of the limit
summed again in float64, so the verdict is the float64 sum's.

The diff reads them per row (analyze/rowscan.py); the trace writer computes them as it writes
each group of rows, from the arrays it holds, and stores them beside the token columns
(`/rowcheck`, docs/format.md): a diff of a trace that has them reads two 1-D columns instead of
both [N, k] columns whole. `stored()` is what the writer stores; `LIMITS` is stamped on the
file, and a file stamped with other limits is scanned afresh.
"""

from __future__ import annotations

import json

import numpy as np

POSITIVE_LIMIT = 1e-3  # a logprob above this is a probability above 1 (rounding gives ~1e-6)
SUM_LIMIT = 1.01  # probabilities of a top-k row: at most 1, with room for rounding
ORDER_TOL = POSITIVE_LIMIT  # an entry may exceed one listed before it by rounding only
CACHE_BYTES = 1 << 20  # rows reduced at a time: fewer, longer numpy calls beat an L2-sized block (measured)

# The stored form: one byte of flags a token row (the positive bit from the top-k row alone: the
# chosen logprob's own check is made where it is read), and the chosen token's entry.
DISORDER, POSITIVE, HEAVY = 1, 2, 4
VERSION = 1  # of the stored form and its checks
LIMITS = json.dumps(
    {"version": VERSION, "order_tol": ORDER_TOL, "positive_limit": POSITIVE_LIMIT, "sum_limit": SUM_LIMIT},
    sort_keys=True,
)


def stored(ids: np.ndarray, lps: np.ndarray, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] float32 the chosen token's entry, [n] uint8 flags) of top-k rows [n, k] and chosen
    ids [n]: what the writer stores of each token row."""
    n = len(tok)
    entry = pick(ids, lps, np.asarray(tok), np.full(n, np.nan, np.float32))
    disorder, positive, heavy = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    if n and lps.ndim == 2 and lps.shape[1]:
        flags(lps, np.full(n, -np.inf, np.float32), (disorder, positive, heavy))
    out = disorder.astype(np.uint8)
    out |= positive.view(np.uint8) * np.uint8(POSITIVE)
    out |= heavy.view(np.uint8) * np.uint8(HEAVY)
    return entry, out


def unpack(bits: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(disorder, positive, heavy) [n] bool of stored flags and the chosen logprobs [n]."""
    with np.errstate(invalid="ignore"):
        positive = (bits & POSITIVE).astype(bool) | (chosen > POSITIVE_LIMIT)
    return (bits & DISORDER).astype(bool), positive, (bits & HEAVY).astype(bool)


def pick(ids: np.ndarray, vals: np.ndarray, tok: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[n] vals at the first entry of each row whose id is tok (NaN when none).
    Engines list the chosen token first almost always: rank 0 is checked for every
    row, the whole row only for the rest. out: an [n] float32 array of NaN to write into."""
    out = np.full(len(tok), np.nan, np.float32) if out is None else out
    if not ids.shape[1] or not len(ids):
        return out
    first = np.equal(ids[:, 0], tok)
    first &= tok >= 0
    np.copyto(out, vals[:, 0], where=first)
    rest = np.flatnonzero(~first)
    if len(rest):
        sub = ids[rest]
        hit = (sub == tok[rest, None]) & (sub >= 0)
        j = hit.argmax(1)
        found = hit.any(1)
        out[rest[found]] = vals[rest[found], j[found]]
    return out


def row_mass(lps: np.ndarray) -> np.ndarray:
    """[n] float64 sum of exp over each row of [n, k] float32 logprobs, NaN entries left out."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(lps)
    return np.where(np.isnan(e), 0.0, e).sum(1, dtype=np.float64)


def flags(lps: np.ndarray, chosen: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """(disorder, positive, heavy) [n] of rows [n, k] into `out`, CACHE_BYTES of rows at a time."""
    step = max(1, CACHE_BYTES // max(1, lps.itemsize * lps.shape[1]))
    for s in range(0, len(lps), step):
        _block_flags(lps[s : s + step], chosen[s : s + step], tuple(x[s : s + step] for x in out))


def _any_per_row(flat: np.ndarray, n: int, k: int) -> np.ndarray:
    """[n] whether each row of a flat bool [n * k] holds a True: the row's bytes read as the
    widest unsigned ints that tile it, OR-ed column by column (a reduction across a short row
    costs numpy a call per row; across the rows it is a few vector passes)."""
    size = next(s for s in (8, 4, 2, 1) if k % s == 0)
    v = flat.view(f"u{size}").reshape(n, k // size)
    acc = v[:, 0].copy()
    for j in range(1, k // size):
        acc |= v[:, j]
    return acc != 0


def _block_flags(lps: np.ndarray, chosen: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    n, k = lps.shape
    disorder, positive, heavy = out  # [n] bool views of the scan's columns, written in place
    flat = lps.reshape(-1)
    hit = np.empty(n * k, bool)
    tmp = np.empty(n * k, np.float32)  # one scratch buffer for both float passes
    with np.errstate(invalid="ignore", over="ignore"):
        hit[0] = False  # an entry above the one before it, within the row (NaN compares False)
        np.add(flat[:-1], np.float32(ORDER_TOL), out=tmp[1:])
        np.greater(flat[1:], tmp[1:], out=hit[1:])
        hit[::k] = False
        # the per-row passes only for a block that holds a finding (a sound block: one reduction)
        disorder[:] = _any_per_row(hit, n, k) if hit.any() else False
        np.greater(chosen, POSITIVE_LIMIT, out=positive)
        if not flat.max() <= POSITIVE_LIMIT:  # a value above the limit, or a NaN (max is NaN)
            np.greater(flat, POSITIVE_LIMIT, out=hit)
            positive |= _any_per_row(hit, n, k)
        # float32 sums of exp: on the bench's 2-core host (numpy 2.4, AVX2, no AVX-512) exp costs
        # 0.46 ms a 1 MiB block, exp2 0.75-1.2 ms and a multiply on top (an earlier session measured
        # exp2 at a third of exp: numpy dispatches them by the CPU's features). The sum only sorts rows (far
        # below the limit: sound; NaN, inf and near it: summed again exactly below), so which
        # function computes it never decides a verdict
        mass = np.exp(flat, out=tmp).reshape(n, k) @ np.ones(k, np.float32)  # NaN where a row holds a NaN
    odd = np.flatnonzero(np.isnan(mass))
    if len(odd):  # a value after a NaN gap is out of order too
        nan = np.isnan(lps[odd])
        disorder[odd] |= (nan[:, :-1] & ~nan[:, 1:]).any(1)
    near = np.flatnonzero(~(mass <= SUM_LIMIT - 1e-3))  # NaN, inf and sums near the limit: exactly
    heavy[:] = False
    if len(near):
        heavy[near] = row_mass(lps[near]) > SUM_LIMIT
