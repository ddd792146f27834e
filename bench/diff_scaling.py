"""`python bench/diff_bench.py --scaling`: the diff's cost at 10k .. 10M positions, each diff in its
own process (diff_bench.py's docstring says what is printed). The traces are diff_bench's
synthetic pairs, written CHUNK positions at a time."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diff_bench import META, K, append, plant, read_floor, synth  # noqa: E402

from tracekit.analyze import diff  # noqa: E402
from tracekit.store import TraceReader, TraceWriter  # noqa: E402

CHUNK = 1_000_000  # positions synthesised and written at a time


def write_pair(d: str, n_pos: int) -> tuple[str, str, dict[str, int]]:
    """A and B of about n_pos positions, written CHUNK positions at a time; the classes planted."""
    pa, pb = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
    planted: dict[str, int] = {}
    rng = np.random.default_rng(1)
    with TraceWriter(pa, META, journal=False) as wa, TraceWriter(pb, META, journal=False) as wb:
        done, first = 0, 0
        for c in range(max(1, -(-n_pos // CHUNK))):
            cols, lens, cls = synth(min(CHUNK, n_pos - done), seed=c)
            b, cached_a, cached_b, status_b = plant(cols, lens, cls, rng)
            append(wa, cols, lens, cached_a, np.full(len(lens), "ok", dtype=object), first)
            append(wb, b, lens, cached_b, status_b, first)
            for k in cls.tolist():
                planted[k] = planted.get(k, 0) + 1
            done, first = done + int(lens.sum()), first + len(lens)
            del cols, b
    return pa, pb, planted


def _hwm_mb() -> float:
    """This process's own peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that over
    exec from the parent (the bench, which synthesised a million positions: 870 MB "peak" for a
    diff that never passed 190 MB)."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


def _child(pa: str, pb: str) -> None:
    """In a fresh process: one diff, then its seconds, counts and the process's peak RSS (JSON).
    A trace longer than stream.POSITIONS token rows is diffed a chunk of pairs at a time."""
    from tracekit.analyze.stream import POSITIONS

    rss0 = _hwm_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    result = diff(pa, pb)
    s, cpu = time.perf_counter() - t0, time.process_time() - c0
    with TraceReader(pa) as r:
        streamed = r.n_token_rows > POSITIONS
    said = {"diff_s": s, "diff_cpu_s": cpu, "counts": result.counts(), "peak_rss_mb": _hwm_mb(), "streamed": streamed}
    print(json.dumps(said | {"rss_before_mb": rss0}))


def _run_child(pa: str, pb: str) -> dict:
    import subprocess

    code = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import diff_scaling as d; "
    code += f"d._child({pa!r}, {pb!r})"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def scaling(sizes: list[int], repeats: int, as_json: bool) -> int:
    rows, ok = [], True
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="diff_scaling_") as d:
            t0 = time.perf_counter()
            pa, pb, planted = write_pair(d, n)
            write_s = time.perf_counter() - t0
            with TraceReader(pa) as r:
                positions = r.n_token_rows
            names = ["token_id", "logprob", "topk_id", "topk_logprob", "topk_logit"]
            floor = min(read_floor(pa, pb, names) for _ in range(repeats)) if n <= 2 * CHUNK else None
            runs = [_run_child(pa, pb) for _ in range(repeats)]
            best = min(runs, key=lambda r: r["diff_s"])
            found = {c: best["counts"][c] for c in planted}
            ok &= found == planted
            rows.append(
                dict(
                    positions=positions,
                    requests=sum(planted.values()),
                    diff_s=best["diff_s"],
                    diff_cpu_s=min(r["diff_cpu_s"] for r in runs),
                    us_per_position=best["diff_s"] / positions * 1e6,
                    cpu_us_per_position=min(r["diff_cpu_s"] for r in runs) / positions * 1e6,
                    read_floor_s=floor,
                    vs_read_floor=best["diff_s"] / floor if floor else None,
                    peak_rss_mb=max(r["peak_rss_mb"] for r in runs),
                    rss_after_import_mb=best["rss_before_mb"],
                    write_s=write_s,
                    streamed=best["streamed"],
                    classes_match=found == planted,
                )
            )
            print(f"{positions:,} positions: diff {best['diff_s']:.3f}s (wrote in {write_s:.1f}s)", file=sys.stderr)

    def fit(key: str, least: int = 0) -> float | None:
        """Slope of log(key) on log(positions) over the sizes >= least (1 = linear)."""
        use = [r for r in rows if r["positions"] >= least]
        if len(use) < 2:
            return None
        return float(np.polyfit(np.log([r["positions"] for r in use]), np.log([r[key] for r in use]), 1)[0])

    for prev, row in zip(rows, rows[1:]):
        for key in ("diff_s", "diff_cpu_s"):
            row[f"slope_{key}"] = float(np.log(row[key] / prev[key]) / np.log(row["positions"] / prev["positions"]))
    # from 100k: above the fixed costs (opening two files, metadata, imports' first use)
    fits = {
        f"slope_fit_{key}{tail}": fit(key, least)
        for key in ("diff_s", "diff_cpu_s")
        for tail, least in (("", 0), ("_from_100k", 100_000))
    }
    out = {"topk": K, "raw_logits": True, "rows": rows, **fits}
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        from tabulate import tabulate

        table = [
            [
                f"{r['positions']:,}",
                f"{r['diff_s']:.3f}",
                f"{r['diff_cpu_s']:.3f}",
                f"{r['cpu_us_per_position']:.3f}",
                f"{r['read_floor_s']:.3f}" if r["read_floor_s"] else "-",
                f"{r['vs_read_floor']:.2f}" if r["vs_read_floor"] else "-",
                f"{r['peak_rss_mb']:.0f}",
                "yes" if r["streamed"] else "no",
                f"{r['write_s']:.0f}",
                f"{r['slope_diff_s']:.2f} / {r['slope_diff_cpu_s']:.2f}" if "slope_diff_s" in r else "",
            ]
            for r in rows
        ]
        heads = [
            "positions",
            "diff s",
            "CPU s",
            "CPU us/position",
            "read floor s",
            "vs floor",
            "peak RSS MB",
            "streamed",
            "write s",
            "slope wall / CPU",
        ]
        print(f"top-{K} + raw logits, one diff per process (best of {repeats})")
        print(tabulate(table, headers=heads, tablefmt="simple", disable_numparse=True))
        said = ", ".join(f"{k[len('slope_fit_') :]} {v:.2f}" for k, v in fits.items() if v is not None)
        print(f"slope of log(seconds) on log(positions) (1 = linear): {said}")
        print(f"classes {'match' if ok else 'MISMATCH'} at every size (planted vs found)")
    return 0 if ok else 1
