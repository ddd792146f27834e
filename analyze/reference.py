"""Each side against a reference: how far A and B are from the truth, at every position.

A benign batch or cache divergence means both sides are roundings of the same truth; a bug
means one side is farther from it than the engine's arithmetic allows. The reference is a
higher-precision replay of the same tokens: the teacher-forced FP32 `full` rows of the HF
diagnostic (`capture --teacher-forced ... --history full --dtype fp32`; picked with
`history=full,dtype=fp32` by default) or the engine's own FP32 configuration's trace.

At every compared position p <= t (t: the first difference; every position of an identical
pair) the three rows share the same prefix, so their distributions are comparable. Per side:

    err(p)  = sum_j w_j |lp_side(j) - lp_ref(j)| / sum_j w_j     over the top-k ids both rows hold,
              w_j = exp(lp_ref(j))                               (the reference's own probability)
    top1(p) = the side's top-1 is the reference's

Per pair: the mean err of each side, B/A as a ratio with a paired bootstrap 95 % interval
over positions, and a one-sided Wilcoxon signed-rank p-value that B's errors exceed A's.
B is *farther* when p < ALPHA, the interval's low end exceeds RATIO_MIN and the excess
exceeds the dtype's floor; *both far* when each side's mean error exceeds the ceiling (a
deterministic bug both runs share, e.g. a prefix-cache key collision). The ceiling is the
dtype's constant (measured on the tiny model), or, when the calibration measured this engine's
healthy error against the reference, max(constant, FAR_K x the largest healthy side's mean
error): a Llama-3-8B-shaped BF16 engine's healthy sides sit 0.13-0.33 nats from FP32, above
the constant. Uncalibrated, a pair whose two sides are the same rows (err A == err B) is never
"both far" by the constant alone: it gets a note (calibrate with --reference to judge it); a
shared cache bug is then the cold reference's to catch (the matrix diffs against one).

Over the run: two roundings of the same truth are as often closer as farther, so the pairs'
log(B/A) are centred on 0. A one-sided Wilcoxon signed-rank test over the pairs whose two
sides differ (p < ALPHA with the median ratio beyond RUN_RATIO and the median excess beyond a
tenth of the dtype's floor) finds a side that is systematically farther even when no pair
alone is conclusive (a small corruption of every reused block). Pairs whose A and B rows are
the same are left out of it (counted, said): they favour neither side. The numbers
are in nats of logprob; the defaults are in docs/analysis.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .align import Alignment, align, load_side

ALPHA = 0.01
RATIO_MIN = 1.5
RUN_RATIO = 1.1  # the run-level test's effect size: median B/A beyond 1.1 (or below 1/1.1)
RUN_MIN_PAIRS = 6  # fewer pairs: no run-level verdict (said)
RUN_FLOOR_SHARE = 0.1  # the run-level excess (median of B's minus median of A's errors) must pass FLOOR/10
BOOT = 1000
SEED = 7
CHUNK = 65536  # positions a vectorised step
# mean weighted |Δ logprob| vs an FP32 reference (nats): an excess below FLOOR is never a
# finding; a mean above CEILING is far from the truth whatever the other side does.
FLOOR = {"bf16": 0.01, "fp16": 0.002, "fp32": 2e-5}
CEILING = {"bf16": 0.25, "fp16": 0.05, "fp32": 0.01}
DEFAULT_SELECT = {"history": "full", "dtype": "fp32"}
# the calibrated ceiling: twice the largest healthy side's mean error (the factor of the drift
# widening, compare.calibrated_thresholds: the largest of n healthy sides underestimates the
# engine's own worst by a margin a second healthy sample shows: 8B BF16 repeats 0.13-0.33 nats)
FAR_K = 2.0


def row_errors(ids_s, lps_s, ids_r, lps_r) -> tuple[np.ndarray, np.ndarray]:
    """(err [M], top1 agreement [M]) of side rows against reference rows, each [M, k]."""
    m = len(ids_s)
    err, top1 = np.full(m, np.nan), np.zeros(m, dtype=bool)
    for s in range(0, m, CHUNK):
        e = slice(s, s + CHUNK)
        a_ids, a_lp = ids_s[e], lps_s[e].astype(np.float64)
        r_ids, r_lp = ids_r[e], lps_r[e].astype(np.float64)
        match = (a_ids[:, :, None] == r_ids[:, None, :]) & (a_ids[:, :, None] >= 0)  # [M, k, kr]
        has = match.any(2)
        lr = np.take_along_axis(r_lp, match.argmax(2), 1)
        ok = has & np.isfinite(a_lp) & np.isfinite(lr)
        w = np.where(ok, np.exp(np.where(ok, lr, -np.inf)), 0.0)
        d = np.where(ok, np.abs(a_lp - lr), 0.0)
        ws = w.sum(1)
        err[e] = np.where(ws > 0, (w * d).sum(1) / np.where(ws > 0, ws, 1), np.nan)
        top1[e] = _argmax_id(a_ids, a_lp) == _argmax_id(r_ids, r_lp)
    return err, top1


def _argmax_id(ids, lps) -> np.ndarray:
    v = np.where(np.isfinite(lps), lps, -np.inf)
    return np.take_along_axis(ids, v.argmax(1)[:, None], 1)[:, 0]


@dataclass(frozen=True)
class PairReference:
    """Per pair [P] (NaN / -1 where there is no reference row)."""

    n: np.ndarray  # positions compared with the reference
    err_a: np.ndarray  # mean weighted |Δ logprob| of A vs the reference (nats)
    err_b: np.ndarray
    p99_a: np.ndarray
    p99_b: np.ndarray
    top1_a: np.ndarray  # share of positions whose top-1 is the reference's
    top1_b: np.ndarray
    ratio: np.ndarray  # err_b / err_a
    ratio_lo: np.ndarray  # paired bootstrap 95 % interval
    ratio_hi: np.ndarray
    p_b_farther: np.ndarray  # one-sided Wilcoxon signed-rank p-value, B's errors > A's
    p_a_farther: np.ndarray
    verdict: np.ndarray  # "" (consistent) | "B farther" | "A farther" | "both far" | "no reference"
    source: str  # what the reference is
    run_pairs: int = 0  # pairs in the run-level test
    run_median_ratio: float = float("nan")
    run_p_b: float = 1.0  # one-sided Wilcoxon over the pairs' log(B/A): B farther
    run_p_a: float = 1.0
    run_verdict: str = ""  # "" | "B farther across the run" | "A farther across the run" | "too few pairs"
    run_equal: int = 0  # pairs left out of the run-level test: A and B equally far (bitwise the same rows)
    note: np.ndarray | None = None  # [P] "" or why a same-rows pair above the constant ceiling is not "both far"
    ceiling: str = ""  # how "both far" was judged (the constant, or the calibrated healthy error)

    @property
    def ok(self) -> bool:
        return self.run_verdict in ("", "too few pairs")


def _stats(ea: np.ndarray, eb: np.ndarray, rng) -> tuple[float, float, float, float, float]:
    """(ratio, lo, hi, p B>A, p A>B) over paired positions."""
    from scipy.stats import wilcoxon

    ma, mb = ea.mean(), eb.mean()
    ratio = mb / ma if ma > 0 else (1.0 if mb == 0 else np.inf)
    idx = rng.integers(0, len(ea), size=(BOOT, len(ea)))
    ba, bb = ea[idx].mean(1), eb[idx].mean(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(ba > 0, bb / np.where(ba > 0, ba, 1), np.where(bb > 0, np.inf, 1.0))
    lo, hi = np.percentile(r, [2.5, 97.5])
    d = eb - ea
    if len(d) < 2 or not np.any(d):
        return float(ratio), float(lo), float(hi), 1.0, 1.0
    pb = float(wilcoxon(d, alternative="greater", zero_method="zsplit").pvalue)
    pa = float(wilcoxon(d, alternative="less", zero_method="zsplit").pvalue)
    return float(ratio), float(lo), float(hi), pb, pa


def against_reference(
    al: Alignment, t: np.ndarray, dtypes: np.ndarray, ref_side, source: str, healthy: dict | None = None
) -> PairReference:
    """Each side of every comparable pair of `al` against the reference Side, positions p <= t.
    healthy: {dtype: the largest healthy side's mean error} from a calibration (else the constant)."""
    # The reference replays A's tokens: its row p is also B's reference for p <= t (same prefix).
    ar = align(al.a, ref_side)
    P = len(al.keys)
    cols = {k: np.full(P, np.nan) for k in ("n", "err_a", "err_b", "p99_a", "p99_b", "top1_a", "top1_b")}
    cols.update({k: np.full(P, np.nan) for k in ("ratio", "ratio_lo", "ratio_hi", "p_b", "p_a")})
    verdict = np.full(P, "no reference", dtype=object)
    note = np.full(P, "", dtype=object)
    healthy = dict(healthy or {})
    ref_a = {k: i for i, k in enumerate(ar.keys.tolist()) if ar.incomparable[i] == ""}
    rng = np.random.default_rng(SEED)
    rd = ref_side.reader
    r_ids, r_lps = rd.column("topk_id"), rd.column("topk_logprob")
    a_ids, a_lps = al.a.reader.column("topk_id"), al.a.reader.column("topk_logprob")
    b_ids, b_lps = al.b.reader.column("topk_id"), al.b.reader.column("topk_logprob")
    for i in np.flatnonzero(al.incomparable == "").tolist():
        key = al.keys[i]
        ja = ref_a.get(key)
        if ja is None:
            continue
        end = int(min(t[i] + 1, al.length[i], ar.length[ja]))
        if end < 1:
            continue
        p = np.arange(end)
        rr = ar.off_b[ja] + p
        ea, ta = row_errors(a_ids[al.off_a[i] + p], a_lps[al.off_a[i] + p], r_ids[rr], r_lps[rr])
        eb, tb = row_errors(b_ids[al.off_b[i] + p], b_lps[al.off_b[i] + p], r_ids[rr], r_lps[rr])
        keep = np.isfinite(ea) & np.isfinite(eb)
        ea, eb = ea[keep], eb[keep]
        if not len(ea):
            continue
        cols["n"][i] = len(ea)
        cols["err_a"][i], cols["err_b"][i] = ea.mean(), eb.mean()
        cols["p99_a"][i], cols["p99_b"][i] = np.percentile(ea, 99), np.percentile(eb, 99)
        cols["top1_a"][i], cols["top1_b"][i] = ta[keep].mean(), tb[keep].mean()
        stats = _stats(ea, eb, rng)
        for k, v in zip(("ratio", "ratio_lo", "ratio_hi", "p_b", "p_a"), stats):
            cols[k][i] = v
        verdict[i], note[i] = _verdict(ea.mean(), eb.mean(), stats, str(dtypes[i]), healthy.get(str(dtypes[i])))
    run = run_test(cols["ratio"], cols["err_a"], cols["err_b"], dtypes)
    said = ", ".join(f"{d} max({CEILING.get(d, CEILING['bf16']):g}, {FAR_K:g} x {v:.3g})" for d, v in healthy.items())
    ceiling = f"calibrated: {said} nats" if healthy else "the documented constant"
    return PairReference(
        cols["n"],
        cols["err_a"],
        cols["err_b"],
        cols["p99_a"],
        cols["p99_b"],
        cols["top1_a"],
        cols["top1_b"],
        cols["ratio"],
        cols["ratio_lo"],
        cols["ratio_hi"],
        cols["p_b"],
        cols["p_a"],
        verdict,
        source,
        *run,
        note,
        ceiling,
    )


def run_test(ratio: np.ndarray, err_a: np.ndarray, err_b: np.ndarray, dtypes: np.ndarray):
    """(pairs, median B/A, p B farther, p A farther, verdict, pairs left out as equal) over the
    pairs' log ratios. Only pairs whose two sides differ count: a pair whose A and B are equally
    far from the reference (bitwise the same rows: a request no cache hit or batch mate touched)
    is no evidence for either side, and counting it as a half-win each way (Wilcoxon's zsplit)
    dilutes a fault that acts on some requests only (perturbed reused KV: the first pass of
    every prompt is untouched). A side is farther across the run only when the excess of its
    median error over those pairs also passes a tenth of the dtype's floor: FP32 sides 1e-7
    nats apart are both exact for any purpose."""
    from scipy.stats import wilcoxon

    ok = np.isfinite(ratio) & (ratio > 0)
    dts = [str(d) for d in np.asarray(dtypes)[ok].tolist()] or ["bf16"]
    floor = RUN_FLOOR_SHARE * FLOOR.get(max(set(dts), key=dts.count), FLOOR["bf16"])
    differ = ok & (err_a != err_b)
    equal = int(ok.sum() - differ.sum())
    r = ratio[differ]
    excess = float(np.median(err_b[differ]) - np.median(err_a[differ])) if differ.any() else 0.0
    if len(r) < RUN_MIN_PAIRS:
        return len(r), float(np.median(r)) if len(r) else float("nan"), 1.0, 1.0, "too few pairs", equal
    lr = np.log(r)
    med = float(np.exp(np.median(lr)))
    if not np.any(lr):
        return len(r), med, 1.0, 1.0, "", equal
    pb = float(wilcoxon(lr, alternative="greater", zero_method="zsplit").pvalue)
    pa = float(wilcoxon(lr, alternative="less", zero_method="zsplit").pvalue)
    verdict = ""
    if pb < ALPHA and med > RUN_RATIO and excess > floor:
        verdict = "B farther across the run"
    elif pa < ALPHA and med < 1 / RUN_RATIO and -excess > floor:
        verdict = "A farther across the run"
    return len(r), med, pb, pa, verdict, equal


def _verdict(ma: float, mb: float, stats, dtype: str, healthy: float | None = None) -> tuple[str, str]:
    """(verdict, note). healthy: the calibration's largest healthy side's error (None: uncalibrated)."""
    ratio, lo, hi, pb, pa = stats
    floor, ceiling = FLOOR.get(dtype, FLOOR["bf16"]), CEILING.get(dtype, CEILING["bf16"])
    if healthy is not None:
        ceiling = max(ceiling, FAR_K * healthy)
    if ma > ceiling and mb > ceiling:
        if healthy is not None or ma != mb:
            return "both far", ""
        return "", (
            f"both sides {ma:.3g} nats from the reference: above the default {dtype} ceiling {ceiling:g} "
            "(measured on the tiny model), the same rows on both sides; calibrate with --reference to judge"
        )
    for side, far, near, p, bound in (("B", mb, ma, pb, lo > RATIO_MIN), ("A", ma, mb, pa, hi < 1 / RATIO_MIN)):
        if p < ALPHA and bound and far - near > floor:
            if healthy is not None and far <= healthy:  # this engine's own healthy sides reach that far
                return "", (
                    f"{side} farther from the reference than {'A' if side == 'B' else 'B'} ({far:.3g} vs {near:.3g} "
                    f"nats) but within this engine's healthy error against it (up to {healthy:.3g} nats, calibrated)"
                )
            return f"{side} farther", ""
    return "", ""


def load_reference(reader, select: dict | None = None):
    """The reference Side of a trace: teacher-forced files default to history=full,dtype=fp32."""
    sel = dict(select or {})
    if not sel and reader.meta.source == "teacher_forced":
        sel = dict(DEFAULT_SELECT)
    side = load_side(reader, sel, "reference")
    what = "teacher-forced " + ",".join(f"{k}={v}" for k, v in sel.items()) if sel else "trace"
    return side, f"{what} ({reader.path})"


def reason(ref: PairReference, i: int) -> str:
    """The rule text of a pair the reference refutes, with its numbers."""
    v = ref.verdict[i]
    nums = (
        f"mean |Δlogprob| vs the reference A {ref.err_a[i]:.3g} / B {ref.err_b[i]:.3g} nats over "
        f"{int(ref.n[i])} positions (B/A {ref.ratio[i]:.3g}, 95% CI {ref.ratio_lo[i]:.3g}-{ref.ratio_hi[i]:.3g}; "
        f"p(B farther) {ref.p_b_farther[i]:.2g}); same top-1 as the reference "
        f"A {ref.top1_a[i]:.0%} / B {ref.top1_b[i]:.0%}"
    )
    what = {
        "B farther": "B is farther from the reference than A",
        "A farther": "A is farther from the reference than B",
        "both far": f"both sides are far from the reference (a bug both runs share?; ceiling: {ref.ceiling})",
    }[v]
    return f"{what}: {nums}"
