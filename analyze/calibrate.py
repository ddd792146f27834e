"""`tracekit calibrate`: measure one engine's noise from healthy repeats.

Each (A, B) pair of traces is two runs of the same prompts on the same engine, model and
dtype that should agree (serial vs serial, burst vs burst, serial vs burst on a healthy
build, --batch-invariant vs default). For every pair of requests it counts the trials and
flips of P(flip | gap) (flip_rate.position_gaps), and the drift before the difference. The
result is a `tracekit.calibration/1` record (tracekit/calibration.py) that `tracekit diff
--calibration` judges a run against. Only healthy runs may go in: a calibration measured on
a broken engine excuses its bug (say where the repeats came from in `--name`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from collections.abc import Sequence

import numpy as np

from tracekit import __version__
from tracekit.calibration import NATS_EDGES, STEP_EDGES, Calibration, GapBins
from tracekit.dtypes import DTYPES
from tracekit.errors import ConfigError
from tracekit.files import sha256_file
from tracekit.percentiles import percentiles
from tracekit.store import TraceReader

from .align import align, load_side
from .compare import diff

QUANTILES = (50, 90, 99, 100)


def _pair_gaps(a: str, b: str, **diff_kwargs):
    """(the diff, its PositionGaps) of one healthy pair of traces."""
    from .flip_rate import position_gaps

    res = diff(a, b, **diff_kwargs)
    c = res.columns
    with contextlib.ExitStack() as stack:
        ra = stack.enter_context(TraceReader(a))
        rb = stack.enter_context(TraceReader(b))
        al = align(load_side(ra, {}, "a"), load_side(rb, {}, "b"))
        t = np.where(c["position"] >= 0, c["position"], al.length).astype(np.int64)
        comparable = c["incomparable"] == ""
        bits = np.array([DTYPES[d].mantissa_bits for d in c["dtype"].tolist()], dtype=np.int64)
        return res, position_gaps(al, t, comparable, bits)


def measure(pairs: Sequence[tuple[str, str]], name: str, **diff_kwargs) -> Calibration:
    """The calibration of the engine that wrote these healthy pairs of traces."""
    if not pairs:
        raise ConfigError("calibrate: give at least one pair of healthy traces (A B)")
    nats, nat_flips, step, step_flips, dmax, dmean = [], [], [], [], [], []
    dtypes, engines, sources, incomparable, n_pairs = set(), [], [], 0, 0
    for a, b in pairs:
        res, g = _pair_gaps(a, b, **diff_kwargs)
        c = res.columns
        ok = c["incomparable"] == ""
        incomparable += int((~ok).sum())
        n_pairs += int(ok.sum())
        nats.append(g.nats)
        nat_flips.append(g.flip_nats)
        if g.steps is not None:
            step.append(g.steps)
            step_flips.append(g.flip_steps)
        dmax.append(c["drift_max"][ok])
        dmean.append(c["drift_mean"][ok])
        dtypes.update(c["dtype"][ok].tolist())
        engines.append(res.labels.get("a", ""))
        sources.append({"a": str(a), "b": str(b), "a_sha256": sha256_file(a), "b_sha256": sha256_file(b)})
    if n_pairs == 0:
        raise ConfigError("calibrate: no comparable pair of requests in the given traces (see `tracekit diff`)")
    if len(dtypes) > 1:
        raise ConfigError(f"calibrate: the traces ran on several grids ({', '.join(sorted(dtypes))}); one dtype a file")
    all_nats, all_nat_flips = np.concatenate(nats), np.concatenate(nat_flips)
    trials, flips = _bins(all_nats, all_nat_flips, NATS_EDGES)
    steps_bins, gmax_steps = None, None
    if step and len(step) == len(pairs):
        all_steps, all_step_flips = np.concatenate(step), np.concatenate(step_flips)
        st, sf = _bins(all_steps, all_step_flips, STEP_EDGES)
        steps_bins = GapBins("steps", STEP_EDGES, st, sf)
        gmax_steps = _max_or_zero(all_step_flips)
    notes = [f"{incomparable} incomparable request pair(s) left out"] if incomparable else []
    return Calibration(
        name=name,
        dtype=dtypes.pop(),
        engine={"labels": sorted(set(engines))},
        pairs=n_pairs,
        flip_nats=GapBins("nats", NATS_EDGES, trials, flips),
        flip_steps=steps_bins,
        drift_max_nats=percentiles(np.concatenate(dmax), QUANTILES, 9),
        drift_mean_nats=percentiles(np.concatenate(dmean), QUANTILES, 9),
        flip_gap_max_nats=_max_or_zero(all_nat_flips),
        flip_gap_max_steps=gmax_steps,
        sources=tuple(sources),
        created_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        writer=f"tracekit {__version__}",
        notes=tuple(notes),
    )


def _bins(gaps, flips_at, edges):
    from .flip_rate import bin_counts

    return bin_counts(gaps, flips_at, edges)


def _max_or_zero(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.max()) if len(x) else 0.0


def default_name(path: str | os.PathLike) -> str:
    return os.path.splitext(os.path.basename(str(path)))[0]
