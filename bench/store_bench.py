"""Store benchmark: write and read 1,000,000 token positions with top-20 ids and logprobs.

Prints a table, or with --json one object. Ratios are measured side by side in
one run: `read_vs_npy` = time to read the columns from the trace ÷ time to read
the same arrays from .npy files (the floor); `bytes_vs_raw` = file size ÷ raw
array bytes. Targets: read_vs_npy <= 2, bytes_vs_raw <= 1.2. `read_vs_npy_crc32` = the
trace read ÷ the .npy read plus zlib's CRC-32 over every array: a floor that, like the
trace's Fletcher-32 checksums, reads each byte once more to verify it (no target; it says
how much of read_vs_npy is the price of checking the bytes at all).
The cost of the Fletcher-32 checksums (every dataset carries them): the same trace
written without them (`TraceWriter(checksums=False)`, what an older tracekit wrote)
side by side, `checksum_write_cost` / `checksum_read_cost` = with ÷ without (write:
CPU seconds; read: the interleaved minimum), for 64-request groups and for one
12-token request a flush (a serial capture of short answers: the worst case, each
flush rewrites and checksums the chunk being filled).

Example: python bench/store_bench.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns  # noqa: E402
from tracekit.store import TraceReader, TraceWriter  # noqa: E402

COLUMNS = ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob")


def make_columns(n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    topk_id = rng.integers(0, 150_000, size=(n, k), dtype=np.int32)
    topk_lp = -np.sort(rng.exponential(2.0, size=(n, k)).astype(np.float32), axis=1)
    return {
        "token_id": topk_id[:, 0].copy(),
        "logprob": topk_lp[:, 0].copy(),
        "t_arrival_s": np.cumsum(rng.random(n)) * 0.01,
        "topk_id": topk_id,
        "topk_logprob": topk_lp,
    }


def write_trace(
    path: Path, cols: dict, k: int, tokens_per_request: int, group: int, checksums: bool = True
) -> tuple[float, float]:
    """(wall s, CPU s) to write the columns as requests of `tokens_per_request`, `group` a flush."""
    n = len(cols["token_id"])
    meta = RunMeta(source="http", run={"bench": "store"}, layout=Layout(topk=k))
    t0, c0 = time.perf_counter(), time.process_time()
    with TraceWriter(path, meta, expected_tokens=n, checksums=checksums) as w:
        batch = []
        for r, s in enumerate(range(0, n, tokens_per_request)):
            e = min(n, s + tokens_per_request)
            toks = TokenColumns(*(cols[c][s:e] for c in COLUMNS))
            batch.append((RequestRecord(key=f"r{r}", prompt_hash="h", status="ok"), toks, None))
            if len(batch) == group:
                w.append_many(batch)
                batch = []
        w.append_many(batch)
    return time.perf_counter() - t0, time.process_time() - c0


def read_trace(path: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    with TraceReader(path) as r:
        got = r.columns(COLUMNS)
    return time.perf_counter() - t0, got


def read_npy(d: Path, check: bool = False) -> float:
    """Seconds to load the .npy arrays; check: and run zlib's CRC-32 over each (a floor that, like
    the trace's Fletcher-32, reads every byte once more to verify it)."""
    t0 = time.perf_counter()
    for c in COLUMNS:
        a = np.load(d / f"{c}.npy")
        if check:
            zlib.crc32(a)
    return time.perf_counter() - t0


def run(n: int, k: int, repeats: int) -> dict:
    cols = make_columns(n, k)
    raw_bytes = sum(a.nbytes for a in cols.values())
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        path, plain = d / "bench.h5", d / "plain.h5"
        # with and without checksums, interleaved twice; the minimum CPU of each
        w_ck, w_plain = [], []
        for _ in range(2):
            w_ck.append(write_trace(path, cols, k, tokens_per_request=256, group=64))
            w_plain.append(write_trace(plain, cols, k, tokens_per_request=256, group=64, checksums=False))
        write_s = min(w for w, _ in w_ck)
        small = {c: a[: 12 * 1000] for c, a in cols.items()}
        s_ck, s_plain = [], []
        for _ in range(2):
            s_ck.append(write_trace(d / "s1.h5", small, k, tokens_per_request=12, group=1)[1])
            s_plain.append(write_trace(d / "s0.h5", small, k, tokens_per_request=12, group=1, checksums=False)[1])
        t0 = time.perf_counter()
        for c, a in cols.items():
            np.save(d / f"{c}.npy", a)
        npy_write_s = time.perf_counter() - t0
        trace_reads, npy_reads, plain_reads, checked_reads = [], [], [], []
        for _ in range(repeats):  # interleaved; minimum of each (both from the page cache)
            s, got = read_trace(path)
            trace_reads.append(s)
            npy_reads.append(read_npy(d))
            plain_reads.append(read_trace(plain)[0])
            checked_reads.append(read_npy(d, check=True))
        for c in COLUMNS:
            assert np.array_equal(got[c], cols[c]), f"column {c} did not round-trip"
        size = os.path.getsize(path)
    tr, nr = min(trace_reads), min(npy_reads)
    return {
        "positions": n,
        "topk": k,
        "raw_bytes": raw_bytes,
        "file_bytes": size,
        "bytes_vs_raw": size / raw_bytes,
        "write_s": write_s,
        "npy_write_s": npy_write_s,
        "read_s": tr,
        "npy_read_s": nr,
        "read_vs_npy": tr / nr,
        "npy_crc32_read_s": min(checked_reads),
        "read_vs_npy_crc32": tr / min(checked_reads),
        "read_positions_per_s": n / tr,
        "write_positions_per_s": n / write_s,
        "write_cpu_s": min(c for _, c in w_ck),
        "write_cpu_s_no_checksum": min(c for _, c in w_plain),
        "checksum_write_cost": min(c for _, c in w_ck) / min(c for _, c in w_plain),
        "read_s_no_checksum": min(plain_reads),
        "checksum_read_cost": tr / min(plain_reads),
        "small_flush_cpu_ms": 1e3 * min(s_ck) / 1000,
        "small_flush_cpu_ms_no_checksum": 1e3 * min(s_plain) / 1000,
        "checksum_small_flush_cost": min(s_ck) / min(s_plain),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Example: python bench/store_bench.py --quick --json"
    )
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="200,000 positions, 15 repeats (a read is ~10 ms: noise)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    n, reps = (200_000, 15) if a.quick else (a.positions, a.repeats)
    res = run(n, a.topk, reps)
    if a.json:
        print(json.dumps(res))
        return
    from tabulate import tabulate

    rows = [
        ["positions", f"{res['positions']:,}"],
        ["top-k", res["topk"]],
        ["raw array bytes", f"{res['raw_bytes']:,}"],
        ["trace file bytes", f"{res['file_bytes']:,}"],
        ["bytes_vs_raw (target <= 1.2)", f"{res['bytes_vs_raw']:.3f}"],
        ["write (trace, 64 requests a flush)", f"{res['write_s']:.3f} s"],
        ["write (.npy)", f"{res['npy_write_s']:.3f} s"],
        ["read (trace)", f"{res['read_s']:.3f} s"],
        ["read (.npy, floor)", f"{res['npy_read_s']:.3f} s"],
        ["read_vs_npy (target <= 2)", f"{res['read_vs_npy']:.2f}"],
        ["read (.npy + CRC-32 of every array)", f"{res['npy_crc32_read_s']:.3f} s"],
        ["read_vs_npy_crc32 (a floor that verifies its bytes too)", f"{res['read_vs_npy_crc32']:.2f}"],
        ["write CPU, with / without checksums", f"{res['write_cpu_s']:.3f} / {res['write_cpu_s_no_checksum']:.3f} s"],
        ["checksum_write_cost (64 requests a flush)", f"{res['checksum_write_cost']:.2f}"],
        ["read, with / without checksums", f"{res['read_s']:.3f} / {res['read_s_no_checksum']:.3f} s"],
        ["checksum_read_cost", f"{res['checksum_read_cost']:.2f}"],
        [
            "12-token request a flush, CPU ms, with / without",
            f"{res['small_flush_cpu_ms']:.2f} / {res['small_flush_cpu_ms_no_checksum']:.2f}",
        ],
        ["checksum_small_flush_cost", f"{res['checksum_small_flush_cost']:.2f}"],
    ]
    print(tabulate(rows, tablefmt="github", headers=["store bench", ""]))


if __name__ == "__main__":
    main()
