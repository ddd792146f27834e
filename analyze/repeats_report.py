"""How `tracekit stats` shows a `StatsResult`: the text tables and the PNG (matplotlib,
Agg, imported lazily). The numbers are computed in `tracekit.analyze.repeats`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .repeats import StatsResult


def plot(result: StatsResult, path: str | Path) -> Path:
    """One PNG: the first-split histogram and the flip rate by top-2 gap (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    pos = result.split_positions
    if len(pos):
        ax1.hist(pos, bins=np.arange(pos.max() + 2) - 0.5, color="#1e88e5")
    ax1.set_xlabel(f"first-divergence position vs the {_ref_words(result.reference)} (generated token, 0-based)")
    ax1.set_ylabel("completions")
    ax1.set_title("where completions first split", fontsize=9)
    fig.suptitle(result.headline(), fontsize=10)
    ax1.grid(alpha=0.3)
    curve = result.gap_steps or result.gap_nats
    rate = curve.rate
    x = np.arange(len(rate))
    ax2.bar(x, np.nan_to_num(rate), color="#e53935")
    for xi, (r, n, f) in enumerate(zip(rate, curve.trials, curve.flips)):
        if n:
            ax2.annotate(f"{f}/{n}", (xi, 0 if np.isnan(r) else r), ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(x, curve.bin_labels(), rotation=35, ha="right", fontsize=8)
    ax2.set_ylim(0, max(float(np.nanmax(rate)) if np.isfinite(rate).any() else 0.0, 0.01) * 1.2)
    ax2.set_xlabel(f"top-2 gap of the reference at that position ({curve.unit})")
    ax2.set_ylabel("flip rate (flips / trials)")
    ax2.set_title("P(flip | gap): a completion that agreed so far picks another token", fontsize=9)
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ref_words(reference: str) -> str:
    return "most common completion" if reference == "mode" else "repeat 0"


def text_report(result: StatsResult, top: int = 20) -> str:
    """The headline, the per-prompt table and the flip-rate table, as plain text."""
    from tabulate import tabulate

    lines = [result.headline(), f"reference: the {_ref_words(result.reference)} of each prompt; positions are 0-based"]
    rows = sorted(result.prompts, key=lambda p: (-p.unique, p.prompt))[:top]
    lines.append(
        tabulate(
            [
                [
                    p.prompt,
                    p.completions,
                    p.unique,
                    f"{p.reference_count}/{p.completions}",
                    "" if p.first_split is None else p.first_split,
                    _median(p.split_positions),
                ]
                for p in rows
            ],
            headers=["prompt", "completions", "unique", "= reference", "first split", "median split"],
            tablefmt="github",
            disable_numparse=True,
        )
    )
    if len(result.prompts) > top:
        lines.append(f"({len(result.prompts) - top} more prompts; --json lists all)")
    for curve in (result.gap_nats, result.gap_steps):
        if curve is None:
            continue
        body = [
            [b, n, f, "" if np.isnan(r) else f"{r:.4f}"]
            for b, n, f, r in zip(curve.bin_labels(), curve.trials, curve.flips, curve.rate)
        ]
        lines.append(f"\nflip rate by the reference's top-2 gap ({curve.unit}):")
        lines.append(
            tabulate(body, headers=["gap", "trials", "flips", "rate"], tablefmt="github", disable_numparse=True)
        )
    if result.skipped_rows:
        lines.append(f"\nnote: {result.skipped_rows} rows were not ok (failed, cancelled, timeout) and are left out")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _median(xs) -> str:
    return "" if not len(xs) else f"{float(np.median(xs)):g}"
