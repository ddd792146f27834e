"""Benchmark `tracekit diff` against the per-position way and against the read floor.

Two synthetic traces of N positions (default 1,000,000) with top-20 ids,
logprobs and raw logits, written through TraceWriter, with planted
divergences of every class. Measured side by side in one run:

  tracekit        tracekit.analyze.diff(A, B): read + align + classify, vectorised, every
                  soundness check on; the row checks of every top-k row (order, sign, mass,
                  the chosen token's entry) read from the trace's /rowcheck, which the writer
                  stores (tracekit/rowcheck.py)
  checks computed the same diff of the same traces without /rowcheck (an older writer's):
                  the row checks computed from both [N, k] columns, read whole
  per-position    the check_logprobs_close way: read the columns, build the
                  per-position {id: logprob} top-k dicts it consumes, run its
                  rule (first differing position: each token in the other's top-k)
  read floor      just reading the compared columns (token_id, logprob,
                  topk_id, topk_logprob, topk_logit) of both files
  read floor 4    what a diff computing the row checks reads whole (all but topk_logit, which
                  it reads at the first differences only)
  read floor diff what the diff reads whole: token_id, logprob and the two /rowcheck columns
  read floor 1-D  reading token_id + logprob only (the least any diff must read)

Targets (issue 25): speedup_vs_per_position >= 30, vs_read_floor <= 1.2.

`--scaling`: the diff's cost at 10k, 100k, 1M positions (`--sizes`, e.g. 1e4,1e5,1e6,1e7), each
diff in its own process: seconds, microseconds a position, the read floor, the process's peak
RSS (its own VmHWM), whether it streamed (traces over analyze/stream.py's POSITIONS token rows:
a chunk of pairs at a time, never both traces in memory), and the slope of log(seconds) over
log(positions) (1 = linear). Traces are written a million positions at a time, each chunk one
group commit (TraceWriter.append_many), so the bench never holds one whole at 10M either.

    python bench/diff_bench.py [--quick] [--json] [--positions N]
    python bench/diff_bench.py --scaling [--sizes 1e4,1e5,1e6,1e7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracekit.analyze import diff  # noqa: E402
from tracekit.analyze.rowscan import STORED  # noqa: E402
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns  # noqa: E402
from tracekit.store import TraceReader, TraceWriter  # noqa: E402

K, EOS, PROMPT = 20, 2, 16
PLANT = {"post_eos": 0.02, "bf16_tie_flip": 0.05, "cache_boundary": 0.02, "unexplained": 0.01, "incomparable": 0.01}


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the BF16 grid (nearest)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)


def _log_softmax(logit: np.ndarray) -> np.ndarray:
    """Logprobs of a top-k row: log-softmax over it plus unseen mass (3 nats below the
    last entry), so the row's probabilities sum to less than 1 and match its logits."""
    z = np.concatenate([logit.astype(np.float64), logit[:, -1:] - 3.0], 1)
    m = z.max(1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(1, keepdims=True))
    return (logit - lse).astype(np.float32)


def synth(n_pos: int, seed: int = 0):
    """A's columns [N] / [N, K], request lengths, and per request the class planted.
    A BF16 run: logits on the BF16 grid (top ~20), logprobs their log-softmax."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(600, 1400, size=max(1, n_pos // 1000))
    lens[-1] += n_pos - lens.sum()
    lens = np.maximum(lens, 8)
    n = int(lens.sum())
    tok = rng.integers(3, 30000, n).astype(np.int32)
    # top-k: the chosen id first, then distinct filler ids from another range, descending logits.
    fill = 40000 + 500 * np.arange(K - 1) + rng.integers(0, 500, (n, K - 1))
    ids = np.concatenate([tok[:, None], fill.astype(np.int32)], 1)
    logit = _bf16(20.0 - np.sort(rng.uniform(0, 12.0, (n, K)), axis=1))
    logit[:, 0] = np.maximum(logit[:, 0], logit[:, 1])  # the chosen token is the top-1
    lp = _log_softmax(logit)
    cls = rng.choice(["identical"] + list(PLANT), size=len(lens), p=[1 - sum(PLANT.values())] + list(PLANT.values()))
    cls[: len(PLANT)] = list(PLANT)  # every class at least once, whatever N
    return dict(tok=tok, ids=ids, lp=lp, logit=logit), lens, cls


def plant(cols, lens, cls, rng):
    """B's columns and per-request edits; returns (b_cols, cached_a, cached_b, skip_b, status_b)."""
    a, b = cols, {k: v.copy() for k, v in cols.items()}
    starts = np.cumsum(lens) - lens
    cached_a, cached_b = np.zeros(len(lens), int), np.zeros(len(lens), int)
    status_b = np.full(len(lens), "ok", dtype=object)
    for i, c in enumerate(cls):  # per request bookkeeping only; edits touch one or two rows
        s, L = int(starts[i]), int(lens[i])
        t = s + int(rng.integers(L // 4, L // 2))
        other = int(a["tok"][t]) + 1
        if c == "post_eos":
            a["tok"][t - 3] = b["tok"][t - 3] = a["ids"][t - 3, 0] = b["ids"][t - 3, 0] = EOS
            b["tok"][t] = b["ids"][t, 0] = other
        elif c in ("bf16_tie_flip", "cache_boundary"):
            steps = 1 if c == "bf16_tie_flip" else 6  # BF16 steps of 1/8 at 20: a tie; beyond it
            for side, first, second in ((a, a["tok"][t], other), (b, other, a["tok"][t])):
                side["ids"][t, :2] = first, second
                side["logit"][t, :2] = 20.0, 20.0 - steps / 8
                # the rest of the row below the second (else the row is out of order: the diff's
                # reported-row check rightly calls such a pair unexplained)
                side["logit"][t, 2:] = np.minimum(side["logit"][t, 2:], 20.0 - (steps + 1) / 8)
                side["lp"][t] = _log_softmax(side["logit"][t : t + 1])[0]
            b["tok"][t] = other
            if c == "cache_boundary":
                cached_b[i] = 8  # inside the 16-token prompt
        elif c == "unexplained":
            b["tok"][t] = b["ids"][t, 0] = 29999 + 40000  # not in A's top-k
        elif c == "incomparable":
            status_b[i] = "error"
    b["lp"] += rng.normal(0, 1e-4, b["lp"].shape).astype(np.float32) * (b["lp"] < -0.6)  # small drift
    return b, cached_a, cached_b, status_b


META = RunMeta(source="http", run={"eos_token_ids": [EOS], "dtype": "bf16"}, layout=Layout(topk=K, raw_logits=True))


def write(path, cols, lens, cached, status):
    with TraceWriter(path, META, journal=False) as w:
        append(w, cols, lens, cached, status)


def append(w, cols, lens, cached, status, first_key: int = 0):
    """The requests of `cols` in one group commit (TraceWriter.append_many: one resize + write a
    column for all of them, as a capture's flush writes what finished). The files are the same
    as a capture's; the journal (crash safety while capturing) is off: nothing here can be lost."""
    starts = np.cumsum(lens) - lens
    prompt = np.arange(PROMPT, dtype=np.int32)
    items = []
    for i, (s, L) in enumerate(zip(starts.tolist(), lens.tolist())):
        e = s + L
        tc = TokenColumns(
            cols["tok"][s:e], cols["lp"][s:e, 0], np.zeros(L), cols["ids"][s:e], cols["lp"][s:e], cols["logit"][s:e]
        )
        rec = RequestRecord(
            key=f"r{first_key + i:08d}",
            prompt_hash="p",
            status=status[i],
            cached_tokens=int(cached[i]),
            finish_reason="length",
        )
        items.append((rec, tc, prompt))
    w.append_many(items, flush=True)


# -- the per-position way (check_logprobs_close) -------------------------------


def per_position(path_a: str, path_b: str) -> tuple[float, float, dict[str, int]]:
    """Read, build per-position top-k dicts per request, run the rule; (total_s, rule_s, verdicts)."""
    t0 = time.perf_counter()
    rule_s = 0.0
    verdicts = {"same": 0, "close": 0, "not_close": 0}
    with TraceReader(path_a) as ra, TraceReader(path_b) as rb:
        ca = ra.columns(["token_id", "topk_id", "topk_logprob"])
        cb = rb.columns(["token_id", "topk_id", "topk_logprob"])
        rows_b = rb.requests.index_by_key()
        for i, key in enumerate(ra.requests.key.tolist()):
            j = rows_b.get(key)
            if j is None or rb.requests.status[j] != "ok":
                continue
            outs = []
            for r, c in ((ra, ca), (rb, cb)):
                row = j if r is rb else i
                s, e = int(r.requests.token_offset[row]), int(r.requests.token_offset[row] + r.requests.n_tokens[row])
                ids, lps = c["topk_id"][s:e].tolist(), c["topk_logprob"][s:e].tolist()
                outs.append((c["token_id"][s:e].tolist(), [dict(zip(a, b)) for a, b in zip(ids, lps)]))
            t1 = time.perf_counter()
            verdicts[_close(outs[0], outs[1])] += 1
            rule_s += time.perf_counter() - t1
    return time.perf_counter() - t0, rule_s, verdicts


def _close(o0, o1) -> str:
    """vLLM's check_logprobs_close rule for one pair, as a verdict instead of an assert."""
    (ids0, lps0), (ids1, lps1) = o0, o1
    for idx, (a, b) in enumerate(zip(ids0, ids1)):
        if a != b:
            return "close" if (a in lps1[idx] and b in lps0[idx]) else "not_close"
    return "same"


def read_floor(path_a: str, path_b: str, names) -> float:
    t0 = time.perf_counter()
    for p in (path_a, path_b):
        with TraceReader(p) as r:
            r.columns(names)
    return time.perf_counter() - t0


def _strip_checks(path: str) -> None:
    """Remove the stored row checks (/rowcheck and its stamp): the trace an older writer wrote."""
    import h5py

    with h5py.File(path, "r+") as f:
        del f["rowcheck"]
        del f.attrs["rowcheck"]


def _best(fn, repeats: int):
    """(wall s, CPU s, result) of the fastest of `repeats` calls (by wall; CPU: the least)."""
    runs = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        r = fn()
        runs.append((time.perf_counter() - t0, time.process_time() - c0, r))
    wall = min(runs, key=lambda x: x[0])
    return wall[0], min(x[1] for x in runs), wall[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="200,000 positions, best of 3 (< 1 minute)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--scaling", action="store_true", help="the cost at 10k, 100k, 1M positions (--sizes)")
    ap.add_argument("--sizes", default="1e4,1e5,1e6", help="positions for --scaling, comma-separated")
    args = ap.parse_args(argv)
    if args.scaling:
        from diff_scaling import scaling  # bench/diff_scaling.py

        return scaling([int(float(x)) for x in args.sizes.split(",")], max(1, min(args.repeats, 2)), args.json)
    # --quick: the diff and the floors best of 3 (a single 0.1 s measurement on a shared machine
    # is noise), the per-position way once
    n_pos, repeats = (200_000, 3) if args.quick else (args.positions, args.repeats)
    rng = np.random.default_rng(1)
    cols, lens, cls = synth(n_pos)
    b, cached_a, cached_b, status_b = plant(cols, lens, cls, rng)
    with tempfile.TemporaryDirectory(prefix="diff_bench_") as d:
        pa, pb = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
        t0 = time.perf_counter()
        write(pa, cols, lens, cached_a, np.full(len(lens), "ok", dtype=object))
        write(pb, b, lens, cached_b, status_b)
        write_s = time.perf_counter() - t0
        del cols, b
        print(f"wrote 2 x {int(lens.sum()):,} positions ({len(lens)} requests) in {write_s:.1f}s", file=sys.stderr)
        names = ["token_id", "logprob", "topk_id", "topk_logprob", "topk_logit"]
        floor, floor_cpu, _ = _best(lambda: read_floor(pa, pb, names), repeats)
        floor_1d, floor_1d_cpu, _ = _best(lambda: read_floor(pa, pb, names[:2]), repeats)
        floor_4, floor_4_cpu, _ = _best(lambda: read_floor(pa, pb, names[:4]), repeats)
        floor_w, floor_w_cpu, _ = _best(lambda: read_floor(pa, pb, names[:2] + list(STORED)), repeats)
        ours, ours_cpu, result = _best(lambda: diff(pa, pb), repeats)
        # the same traces as a writer without stored row checks leaves them (an older tracekit's):
        # the diff computes the checks from both [N, k] columns, read whole
        qa, qb = os.path.join(d, "a0.h5"), os.path.join(d, "b0.h5")
        for src, dst in ((pa, qa), (pb, qb)):
            shutil.copyfile(src, dst)
            _strip_checks(dst)
        cold, cold_cpu, cold_result = _best(lambda: diff(qa, qb), repeats)
        assert cold_result.counts() == result.counts()
        pp_s, pp_cpu, (_, rule_s, verdicts) = _best(lambda: per_position(pa, pb), max(1, repeats - 2))
    planted = {c: int(np.sum(cls == c)) for c in ["identical"] + list(PLANT)}
    found = {c: result.counts()[c] for c in planted}
    out = {
        "positions": int(lens.sum()),
        "requests": len(lens),
        "topk": K,
        "raw_logits": True,
        "tracekit_diff_s": ours,
        "tracekit_diff_checks_computed_s": cold,
        "tracekit_diff_checks_computed_cpu_s": cold_cpu,
        "checks_computed_speedup_vs_per_position": pp_s / cold,
        "checks_computed_vs_read_floor": cold / floor,
        "read_floor_diff_reads_s": floor_w,
        "vs_read_floor_diff_reads": ours / floor_w,
        "per_position_s": pp_s,
        "per_position_rule_s": rule_s,
        "read_floor_s": floor,
        "read_floor_1d_s": floor_1d,
        "read_floor_4_s": floor_4,
        "vs_read_floor_4": ours / floor_4,
        "read_floor_4_cpu_s": floor_4_cpu,
        "write_s": write_s,
        "speedup_vs_per_position": pp_s / ours,
        "vs_read_floor": ours / floor,
        "vs_read_floor_1d": ours / floor_1d,
        # the same in CPU seconds of this process (time.process_time): a shared machine's load
        # stretches wall seconds unevenly, CPU seconds far less
        "tracekit_diff_cpu_s": ours_cpu,
        "per_position_cpu_s": pp_cpu,
        "read_floor_cpu_s": floor_cpu,
        "read_floor_1d_cpu_s": floor_1d_cpu,
        "speedup_vs_per_position_cpu": pp_cpu / ours_cpu,
        "vs_read_floor_cpu": ours_cpu / floor_cpu,
        "planted": planted,
        "found": found,
        "classes_match": planted == found,
        "per_position_verdicts": verdicts,
        "targets": {"speedup_vs_per_position": ">= 30", "vs_read_floor": "<= 1.2"},
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from tabulate import tabulate

        rows = [
            ["tracekit diff (read + align + classify)", f"{ours:.3f}", "1.00", f"{ours_cpu:.3f}", "1.00"],
            [
                "per-position (check_logprobs_close way)",
                f"{pp_s:.3f}",
                f"{pp_s / ours:.1f}x slower",
                f"{pp_cpu:.3f}",
                f"{pp_cpu / ours_cpu:.1f}x slower",
            ],
            ["... of which its rule", f"{rule_s:.3f}", "", "", ""],
            [
                "tracekit diff, row checks computed (no /rowcheck)",
                f"{cold:.3f}",
                f"{cold / ours:.2f}x; {pp_s / cold:.1f}x faster than per-position",
                f"{cold_cpu:.3f}",
                f"{cold_cpu / ours_cpu:.2f}x",
            ],
            [
                "read floor (5 compared columns)",
                f"{floor:.3f}",
                f"diff = {ours / floor:.2f}x floor",
                f"{floor_cpu:.3f}",
                f"diff = {ours_cpu / floor_cpu:.2f}x floor",
            ],
            [
                "read floor 4 columns (what a diff computing the row checks reads whole)",
                f"{floor_4:.3f}",
                f"diff = {ours / floor_4:.2f}x floor",
                f"{floor_4_cpu:.3f}",
                f"diff = {ours_cpu / floor_4_cpu:.2f}x floor",
            ],
            [
                "read floor, what the diff reads whole (1-D + /rowcheck)",
                f"{floor_w:.3f}",
                f"diff = {ours / floor_w:.2f}x floor",
                f"{floor_w_cpu:.3f}",
                f"diff = {ours_cpu / floor_w_cpu:.2f}x floor",
            ],
            [
                "read floor 1-D (token_id, logprob)",
                f"{floor_1d:.3f}",
                f"diff = {ours / floor_1d:.2f}x floor",
                f"{floor_1d_cpu:.3f}",
                f"diff = {ours_cpu / floor_1d_cpu:.2f}x floor",
            ],
        ]
        print(f"{out['positions']:,} positions, {out['requests']} requests, top-{K} + raw logits")
        heads = ["method", "seconds", "ratio", "CPU seconds", "CPU ratio"]
        print(tabulate(rows, headers=heads, tablefmt="simple", disable_numparse=True))
        print(
            f"classes planted {planted}\nclasses found   {found}  ({'match' if out['classes_match'] else 'MISMATCH'})"
        )
    return 0 if out["classes_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
