"""Does a fault of the family move outputs beyond the engine's own noise? (reads a family run)

`bench/sensitivity.py --family --keep DIR` keeps every trace; this reads them back for one
kind (default `batch-scale`, whose BF16 burst passes the calibrated + reference yardstick) and
puts the fault's effect beside the healthy engine's noise, in both dtypes:

- FP32 (noise ~1e-6 nats, so what moves is the fault): each side's mean error against the FP32
  reference, the median per-pair excess B - A, the drift of the chosen logprobs, for the faulty
  burst and for each held-out healthy burst;
- BF16: the same numbers, plus the faulty burst's per-pair log(B/A) against the pooled held-out
  healthy bursts' (Mann-Whitney), the shift of its median, and how many pairs whose sides differ a
  one-sided Wilcoxon at the run-level test's alpha (0.01) would need to see that shift with 95 %
  power at the healthy spread (n = ((z_0.99 + z_0.95) sd / shift)^2 / 0.955).

Usage: python bench/family_noise.py --bf16 DIR --fp32 DIR [--kind batch-scale] [--json]
(DIR: a `--keep` directory of `sensitivity.py --family`, one dtype or both; the two may be the same.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sensitivity_family import yardstick_stats  # noqa: E402

from tracekit.analyze.compare import diff  # noqa: E402
from tracekit.calibration import read_calibration  # noqa: E402


def _healthy(d: Path, dtype: str) -> list[Path]:
    runs = sorted(d.glob(f"{dtype}_healthy_c8_*.h5"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    return runs[len(runs) // 2 :]  # the held-out half (the first half made the calibration)


def judge(d: Path, dtype: str, b: Path) -> tuple[dict, np.ndarray]:
    """yardstick_stats of diff(base, b) on the family's calibration and reference, and the
    per-pair log(B/A) of the pairs whose two sides differ."""
    base = d / f"{dtype}_healthy_serial.h5"
    cal = read_calibration(d / f"{dtype}_calibration.json")
    res = diff(base, b, calibration=cal, reference=d / f"{dtype}_reference_fp32.h5")
    ref = res.reference
    ok = np.isfinite(ref.ratio) & (ref.err_a != ref.err_b)
    st = yardstick_stats(res) | {"ok": res.ok, "counts": {k: v for k, v in res.counts().items() if v}}
    drift = res.columns["drift_mean"][res.columns["incomparable"] == ""].astype(float)
    st["drift_mean_median"] = float(np.nanmedian(drift)) if np.isfinite(drift).any() else None
    return st, np.log(ref.ratio[ok])


def dtype_rows(d: Path, dtype: str, kind: str) -> dict:
    from scipy.stats import mannwhitneyu

    faulty, lr_f = judge(d, dtype, d / f"{dtype}_{kind}_burst.h5")
    healthy, lr_h = [], []
    for h in _healthy(d, dtype):
        st, lr = judge(d, dtype, h)
        healthy.append(st)
        lr_h.append(lr)
    pooled = np.concatenate(lr_h) if lr_h else np.zeros(0)
    out = {"dtype": dtype, "faulty": faulty, "healthy": healthy}
    if len(lr_f) and len(pooled):
        shift = float(np.median(lr_f) - np.median(pooled))
        sd = float(np.std(pooled, ddof=1))
        out["log_ratio"] = {
            "faulty_median": float(np.median(lr_f)),
            "healthy_median": float(np.median(pooled)),
            "healthy_sd": sd,
            "shift": shift,
            "mann_whitney_p": float(mannwhitneyu(lr_f, pooled, alternative="greater").pvalue),
            "pairs_needed": float(((2.326 + 1.645) * sd / shift) ** 2 / 0.955) if shift > 0 else None,
            "pairs_faulty": int(len(lr_f)),
            "pairs_healthy": int(len(pooled)),
        }
    return out


def _range(xs: list[float | None]) -> str:
    v = [x for x in xs if x is not None]
    return f"{min(v):.3g} .. {max(v):.3g}" if v else "n/a"


def table(rows: list[dict], kind: str) -> str:
    out = [
        f"`{kind}` burst vs the healthy serial baseline, against the FP32 reference (medians over the pairs "
        "whose sides differ); healthy: the 10 held-out healthy bursts (range)",
        "",
        "| dtype | run | pairs that differ | error A (nats) | error B (nats) | excess B - A | median B/A "
        "| Wilcoxon p (B farther) | flips obs / exp | chosen-logprob drift, per-pair mean (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, h = r["faulty"], r["healthy"]
        out.append(
            f"| {r['dtype']} | faulty | {f['pairs_differ']} | {f['err_a']:.3g} | {f['err_b']:.3g} | {f['excess']:.3g} "
            f"| {f['median_ratio']:.3g} | {f['p_b']:.2g} | {f['flips']} / {f['flips_expected']:.3g} "
            f"| {f['drift_mean_median']:.3g} |"
        )
        out.append(
            f"| {r['dtype']} | healthy x{len(h)} | {_range([x['pairs_differ'] for x in h])} "
            f"| {_range([x['err_a'] for x in h])} | {_range([x['err_b'] for x in h])} "
            f"| {_range([x['excess'] for x in h])} | {_range([x['median_ratio'] for x in h])} "
            f"| {_range([x['p_b'] for x in h])} | {_range([x['flips'] for x in h])} "
            f"| {_range([x['drift_mean_median'] for x in h])} |"
        )
    for r in rows:
        lr = r.get("log_ratio")
        if lr:
            need = f"{lr['pairs_needed']:.0f}" if lr["pairs_needed"] else "never (no shift)"
            out.append(
                f"\n{r['dtype']}: per-pair log(B/A) faulty median {lr['faulty_median']:.3g} "
                f"({lr['pairs_faulty']} pairs) "
                f"vs healthy {lr['healthy_median']:.3g} (sd {lr['healthy_sd']:.3g}, {lr['pairs_healthy']} pairs): "
                f"shift {lr['shift']:.3g}, Mann-Whitney p {lr['mann_whitney_p']:.2g}; pairs needed to see it "
                f"(alpha 0.01, power 0.95): {need}"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path)
    ap.add_argument("--fp32", type=Path)
    ap.add_argument("--kind", default="batch-scale")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [dtype_rows(d, dt, args.kind) for dt, d in (("bf16", args.bf16), ("fp32", args.fp32)) if d]
    if not rows:
        raise SystemExit("give --bf16 DIR and/or --fp32 DIR (the --keep directory of sensitivity.py --family)")
    print(json.dumps(rows, indent=1, default=str) if args.json else table(rows, args.kind))


if __name__ == "__main__":
    main()
