"""PNG plots of a run directory (matplotlib, Agg backend, imported lazily):

- classes.png: divergence classes across the matrix, a cell x class heatmap of pair counts;
- gaps.png: at each divergence, the gap between the two competing tokens in the
  reference trace (ULPs of the raw logits, symlog; nats on a panel of its own for pairs
  without raw logits) against the position where it happened, one panel per grid (BF16 and
  FP32 ULPs never share an axis), each with its own tie line;
- drift.png: chosen-token logprobs of one pair (baseline vs burst) along the
  sequence, their |difference|, and the divergence position.

Reads only DIR, through `tracekit.rundir` (cells, diffs) and the traces. Never imports capture/.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracekit.dtypes import NAMES as DTYPE_NAMES
from tracekit.errors import ConfigError
from tracekit.rundir import Cell, DiffSummary, LoadedCell, PairEvidence, RunDir
from tracekit.store import TraceReader
from tracekit.verdicts import NAMES, Verdict

# Column / legend order and colours: the verdict vocabulary's (tracekit/verdicts.py).
ORDER = NAMES
COLORS = {v.value: v.colour for v in Verdict}


MARKERS = ("s", "o", "^")  # one per tracekit.dtypes name: fp32, bf16, fp16


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(c: Cell) -> str:
    return c.label()


def heatmap(diffs: list[tuple[LoadedCell, DiffSummary]], out: Path) -> None:
    plt = _plt()
    counts = np.array([[d.counts[k] for k in ORDER] for _, d in diffs], dtype=float)  # [cells, classes]
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * len(diffs) + 1.8))
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for i, j in np.ndindex(counts.shape):
        bad = ORDER[j] in ("unexplained", "incomparable") and counts[i, j] > 0
        ax.text(
            j,
            i,
            f"{int(counts[i, j])}",
            ha="center",
            va="center",
            fontsize=9,
            color="#b71c1c" if bad else ("white" if share[i, j] > 0.6 else "black"),
            fontweight="bold" if bad else "normal",
        )
    ax.set_xticks(range(len(ORDER)), [c.replace("_", " ") for c in ORDER], rotation=20)
    ax.set_yticks(range(len(diffs)), [_label(c.cell) for c, _ in diffs], fontsize=8)
    ax.set_title("Divergence classes per cell (pairs: serial baseline vs concurrent burst)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _gap(p: PairEvidence, unit: str) -> float | None:
    """The reference trace's gap of a pair in `unit`: steps of its grid from raw logits, or nats
    where no logits were stored (logprob-only engines: llama.cpp, SGLang, TGI)."""
    if unit == "ulp":
        return p.gap_a_ulp
    return p.gap_a if p.gap_a_ulp is None else None


def _grid(c, d: DiffSummary) -> str:
    """The grid a diff counted its ULPs on (its thresholds' dtype; the cell's dtype for diffs
    that do not say)."""
    g = d.thresholds.get("dtype")
    return g if isinstance(g, str) and g in DTYPE_NAMES else c.cell.dtype


def _points(group, cls: str, unit: str) -> list[tuple[float, float]]:
    return [
        (p.position, abs(g))
        for _, d in group
        for p in d.pairs
        if p.cls == cls and p.position is not None and (g := _gap(p, unit)) is not None
    ]


def gap_panels(diffs) -> dict[str, dict]:
    """What gaps.png draws: one panel per grid and unit, named "bf16" / "fp32" (ULPs of that grid
    from raw logits) and "bf16 nats" ... (pairs without raw logits), each with its points and that
    grid's own tie tolerances. A BF16 step and an FP32 step differ 2^16-fold, so their ULPs never
    share an axis and the FP32 tie line (64 ulp) never sits under BF16 points judged at 4 ulp.
    Panels without points are left out; {} when no pair has a gap."""
    out = {}
    for unit in ("ulp", "nats"):
        key = "tie_ulps" if unit == "ulp" else "tie_nats"
        for grid in DTYPE_NAMES:
            group = [(c, d) for c, d in diffs if _grid(c, d) == grid]
            n = sum(len(_points(group, cls, unit)) for cls in ORDER)
            if n:
                ties = sorted({float(d.thresholds[key]) for _, d in group if key in d.thresholds})
                out[grid if unit == "ulp" else f"{grid} nats"] = {"grid": grid, "unit": unit, "points": n, key: ties}
    return out


def _gap_panel(ax, rng, group, grid: str, unit: str, ties: list[float]) -> int:
    n, top = 0, 1.0 if unit == "ulp" else 1e-3
    for cls in ORDER:
        pts = _points(group, cls, unit)
        if pts:
            x, y = np.array(pts, dtype=float).T
            ax.scatter(
                x + rng.uniform(-0.2, 0.2, len(x)),
                y,
                s=30,
                marker=MARKERS[DTYPE_NAMES.index(grid)],
                color=COLORS[cls],
                alpha=0.75,
                label=f"{cls} ({len(pts)})",
                edgecolors="black",
                linewidths=0.3,
            )
            n += len(pts)
            top = max(top, float(y.max()))
    for tie in ties:  # this grid's own tolerances (a calibration may widen some cells'), each once
        ax.axhline(tie, color="#1e88e5", ls="--", lw=1)
        ax.text(ax.get_xlim()[1], tie, f" tie tolerance {tie:g} {unit}", va="bottom", ha="right", fontsize=8,
                color="#1e88e5")  # fmt: skip
    if unit == "ulp":
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(-0.3, max([top, *ties]) * 3)
        ax.set_ylabel(f"top-2 gap in the reference trace\n(ULPs of the {grid.upper()} grid; 0 = exact tie)")
    else:
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_ylim(0, max([top, *ties]) * 3)
        ax.set_ylabel(f"top-2 gap in the reference trace\n(nats, {grid.upper()}: logprobs only, no raw logits)")
    ax.set_xlabel("generated position of the first differing token")
    ax.set_title(f"{grid.upper()} grid, {'ULPs' if unit == 'ulp' else 'nats'}: {n} divergences", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="class (pairs)", title_fontsize=8)
    ax.grid(alpha=0.3)
    return n


def gap_scatter(diffs: list[tuple[LoadedCell, DiffSummary]], out: Path) -> int:
    """One point per divergent pair: the reference trace's gap between the two tokens, one panel
    per grid (gap_panels): ULPs of that grid's raw logits (symlog: 0 = an exact tie) with that
    grid's tie line, and nats on panels of their own for pairs without raw logits (logprob-only
    engines); returns how many were drawn."""
    plt = _plt()
    panels = gap_panels(diffs)
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(10, 4.5 * max(1, len(panels))), squeeze=False)
    rng = np.random.default_rng(0)  # x jitter only, so equal (position, gap) points stay visible
    n = 0
    for ax, p in zip(axes[:, 0], panels.values()):
        group = [(c, d) for c, d in diffs if _grid(c, d) == p["grid"]]
        n += _gap_panel(ax, rng, group, p["grid"], p["unit"], p["tie_ulps" if p["unit"] == "ulp" else "tie_nats"])
    fig.suptitle("Gap between the two competing tokens at each divergence (one panel per grid)", fontsize=10)
    if not n:
        axes[0, 0].text(0.5, 0.5, "no divergence in this run", transform=axes[0, 0].transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return n


def pick_pair(diffs: list[tuple[LoadedCell, DiffSummary]]) -> tuple[LoadedCell, PairEvidence] | None:
    """The pair to draw: the first unexplained, else the latest-position benign divergence."""
    best, score = None, None
    for c, d in diffs:
        for p in d.pairs:
            if p.position is None or p.cls in ("identical", "incomparable"):
                continue
            s = (p.cls == "unexplained", p.position)
            if score is None or s > score:
                best, score = (c, p), s
    return best


def _logprobs(path: Path, key: str) -> np.ndarray:
    with TraceReader(path) as r:
        i = r.requests.index_by_key()[key]
        return np.asarray(r.tokens(i).logprob, dtype=np.float64)


def drift(rd: RunDir, lc: LoadedCell, pair: PairEvidence, out: Path) -> None:
    plt = _plt()
    r = lc.record
    a, b = _logprobs(rd.path(r.baseline), pair.key), _logprobs(rd.path(r.burst), pair.key)
    n = min(len(a), len(b))
    t = pair.position
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[2, 1])
    ax1.plot(np.arange(len(a)), a, "o-", ms=3, label="serial baseline (A)", color="#1e88e5")
    ax1.plot(np.arange(len(b)), b, "s--", ms=3, label="concurrent burst (B)", color="#e53935", alpha=0.8)
    ax1.set_ylabel("chosen-token logprob, nats")
    d = np.abs(a[:n] - b[:n])
    ax2.semilogy(np.arange(n), np.maximum(d, 1e-9), "k.-", ms=3)
    ax2.set_ylabel("|Δ logprob|, nats\n(floored at 1e-9)")
    ax2.set_xlabel("generated position")
    for ax in (ax1, ax2):
        ax.axvline(t, color=COLORS.get(pair.cls, "k"), ls=":", lw=1.5)
        ax.axvspan(t, max(n, t + 1) - 0.5, color="#eeeeee", zorder=0)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax1.set_title(
        f"{_label(lc.cell)} · key {pair.key}\n{pair.cls} at position {t} "
        f"(tokens {pair.token_a} vs {pair.token_b}); grey: after the divergence",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def make_plots(
    rd: RunDir, cells: list[LoadedCell], out_dir: str | Path, pair: tuple[str, str] | None = None
) -> dict[str, str]:
    """Write the PNGs under out_dir; returns {name: path}. pair = (cell id, key) for drift.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    diffs = [(c, c.diff) for c in cells if c.diff is not None]
    if not diffs:
        return {}
    paths = {"classes": out_dir / "classes.png", "gaps": out_dir / "gaps.png"}
    heatmap(diffs, paths["classes"])
    gap_scatter(diffs, paths["gaps"])
    chosen = pick_pair(diffs)
    if pair is not None:
        cd = next(((c, d) for c, d in diffs if c.cell.id == pair[0]), None)
        p = next((p for p in cd[1].pairs if p.key == pair[1]), None) if cd else None
        if p is None or p.position is None:
            raise ConfigError(f"--pair {pair[0]}:{pair[1]}: no such diverging pair in the run")
        chosen = (cd[0], p)
    if chosen is not None and chosen[0].record.baseline and chosen[0].record.burst:
        paths["drift"] = out_dir / "drift.png"
        drift(rd, chosen[0], chosen[1], paths["drift"])
    return {k: str(v) for k, v in paths.items()}
