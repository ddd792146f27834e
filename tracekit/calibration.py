"""The calibration record: one engine's measured noise, stored beside its traces.

A tolerance tuned on one model does not transfer to another shape, engine or dtype, so
tracekit measures the yardstick on the engine under test (`tracekit calibrate`, from
healthy repeats: serial vs serial, burst vs burst, batch-invariant vs default) and every
verdict names the record it used. The record holds:

- `flip`: P(flip | top-2 gap), as trials and flips per gap bin, in nats (every trace has
  logprobs) and, where the traces carry raw logits, in steps of the run's grid;
- `drift`: the distribution of each healthy pair's max and mean |Δ chosen logprob| before
  its first difference (nats), as quantiles;
- `flip_gap_max`: the largest top-2 gap at which a healthy repeat flipped (nats, steps);
- `gap_move` (version 2): how far the top-2 gap (A's top-1 minus A's runner-up, the same two
  ids read in B's row) moves between the two runs, |g_A - g_B'|, at every position before the
  first difference where both rows hold both candidates: quantiles in nats and, with raw
  logits, in steps of the grid; n positions. A flip whose total move (A's gap + B's gap) lies
  within this is a tie (compare.calibrated_thresholds);
- `ref_error` (version 2, only when measured with `--reference`): each healthy side's mean
  weighted |Δlogprob| against the higher-precision reference (analyze/reference.py), as
  quantiles over the sides; the reference it was measured against; n sides. The "both far"
  judgement uses it instead of the tiny model's constant ceiling;
- what it was measured on: engine self-report, model, dtype, the traces and their sha256.

JSON, schema `tracekit.calibration/2` (a newer version is refused with both versions named;
a missing field is an error, never a guess; a version-1 record is read with `gap_move` and
`ref_error` absent, None). This module is only the record and its file;
the measurement is `tracekit.analyze.calibrate`, the run-level test `tracekit.analyze.flip_rate`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError, SchemaVersionError, TraceFormatError

SCHEMA = "tracekit.calibration"
VERSION = 2
# Gap bin edges. nats: top-2 logprob gaps; steps: the same gap counted on the run's grid.
NATS_EDGES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, math.inf)
STEP_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0, 256.0, math.inf)


@dataclass(frozen=True)
class GapBins:
    """Trials (compared positions whose top-2 gap fell in the bin) and flips (first
    differences at such a gap) per bin [lo, hi)."""

    unit: str  # "nats" | "steps"
    edges: tuple[float, ...]  # len(bins) + 1, ascending, last may be inf
    trials: tuple[int, ...]
    flips: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.edges) - 1
        if n < 1 or len(self.trials) != n or len(self.flips) != n:
            raise ConfigError(f"calibration: {self.unit} bins: {len(self.edges)} edges need {n} trials and flips")
        if any(f > t or f < 0 for f, t in zip(self.flips, self.trials)):
            raise ConfigError(f"calibration: {self.unit} bins: a bin has more flips than trials")

    @property
    def total_trials(self) -> int:
        return sum(self.trials)

    @property
    def total_flips(self) -> int:
        return sum(self.flips)

    def to_json(self) -> dict:
        return {
            "unit": self.unit,
            "edges": [e if math.isfinite(e) else "inf" for e in self.edges],
            "trials": list(self.trials),
            "flips": list(self.flips),
        }

    @classmethod
    def from_json(cls, o: dict, where: str) -> "GapBins":
        edges = tuple(math.inf if e == "inf" else float(e) for e in _need(o, "edges", where))
        return cls(
            str(_need(o, "unit", where)),
            edges,
            tuple(int(x) for x in _need(o, "trials", where)),
            tuple(int(x) for x in _need(o, "flips", where)),
        )


@dataclass(frozen=True)
class Calibration:
    """One engine/model/dtype's measured noise (see the module docstring)."""

    name: str  # how verdicts name it (default: the file's stem)
    dtype: str  # the grid the repeats ran on (fp32 | bf16 | fp16 | a quantized name | unknown)
    engine: dict  # the engine's self-report as the traces recorded it (model, family, version, ...)
    pairs: int  # healthy pairs measured
    flip_nats: GapBins
    flip_steps: GapBins | None  # None when the traces carry no raw logits
    drift_max_nats: dict  # quantiles of each pair's max |Δ chosen logprob| before its difference
    drift_mean_nats: dict
    flip_gap_max_nats: float  # the largest gap a healthy repeat flipped at (0 when none flipped)
    flip_gap_max_steps: float | None
    sources: tuple[dict, ...] = ()  # [{"a": path, "b": path, "a_sha256": ..., "b_sha256": ...}]
    created_utc: str = ""
    writer: str = ""
    version: int = VERSION
    notes: tuple[str, ...] = field(default=())
    # version 2: None when not measured (a version-1 record; calibrate without --reference)
    gap_move: dict | None = None  # {"n": positions, "nats": {p50..p100}, "steps": {p50..p100} | None}
    ref_error: dict | None = None  # {"reference": what, "n": sides, "mean_nats": {p50..p100}}

    @property
    def gap_move_max(self) -> tuple[float, float | None] | None:
        """(nats, steps or None): the largest healthy gap move, None when not measured."""
        g = self.gap_move
        if not g or not g.get("n"):
            return None
        steps = (g.get("steps") or {}).get("p100")
        return float(g["nats"]["p100"]), None if steps is None else float(steps)

    @property
    def ref_error_max(self) -> float | None:
        """The largest healthy side's mean error against the reference (nats), None when not measured."""
        r = self.ref_error
        return float(r["mean_nats"]["p100"]) if r and r.get("n") else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["flip_nats"] = self.flip_nats.to_json()
        d["flip_steps"] = None if self.flip_steps is None else self.flip_steps.to_json()
        d["sources"] = list(self.sources)
        d["notes"] = list(self.notes)
        return {"schema": f"{SCHEMA}/{self.version}", **{k: v for k, v in d.items() if k != "version"}}

    def describe(self) -> str:
        """'cal-bf16 (bf16, 48 healthy pairs, 5 flips: max gap 0.0312 nats / 6 steps)'"""
        steps = f" / {self.flip_gap_max_steps:g} steps" if self.flip_gap_max_steps is not None else ""
        more = ""
        if (gm := self.gap_move_max) is not None:
            more += f"; gap move max {gm[0]:.3g} nats" + (f" / {gm[1]:g} steps" if gm[1] is not None else "")
        if (re_ := self.ref_error_max) is not None:
            more += f"; error vs the reference max {re_:.3g} nats over {self.ref_error['n']} sides"
        return (
            f"{self.name} ({self.dtype}, {self.pairs} healthy pairs, {self.flip_nats.total_flips} flips: "
            f"max gap {self.flip_gap_max_nats:.3g} nats{steps}{more})"
        )


def _need(o: dict, key: str, where: str):
    if key not in o:
        raise TraceFormatError(f"{where}: calibration field {key!r} missing; recreate it with `tracekit calibrate`")
    return o[key]


def parse_calibration(doc: dict, where: str = "calibration") -> Calibration:
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(schema, str) or not schema.startswith(SCHEMA + "/"):
        raise TraceFormatError(f"{where}: not a {SCHEMA} document (schema {schema!r})")
    try:
        version = int(schema.rsplit("/", 1)[1])
    except ValueError:
        raise TraceFormatError(f"{where}: bad schema {schema!r}") from None
    if version > VERSION:
        raise SchemaVersionError(
            f"{where}: calibration version {version} is newer than this tracekit reads ({VERSION}); upgrade tracekit"
        )
    steps = _need(doc, "flip_steps", where)
    gmax_steps = _need(doc, "flip_gap_max_steps", where)
    return Calibration(
        name=str(_need(doc, "name", where)),
        dtype=str(_need(doc, "dtype", where)),
        engine=dict(_need(doc, "engine", where)),
        pairs=int(_need(doc, "pairs", where)),
        flip_nats=GapBins.from_json(_need(doc, "flip_nats", where), where),
        flip_steps=None if steps is None else GapBins.from_json(steps, where),
        drift_max_nats=dict(_need(doc, "drift_max_nats", where)),
        drift_mean_nats=dict(_need(doc, "drift_mean_nats", where)),
        flip_gap_max_nats=float(_need(doc, "flip_gap_max_nats", where)),
        flip_gap_max_steps=None if gmax_steps is None else float(gmax_steps),
        sources=tuple(doc.get("sources") or ()),
        created_utc=str(doc.get("created_utc", "")),
        writer=str(doc.get("writer", "")),
        version=version,
        notes=tuple(doc.get("notes") or ()),
        gap_move=_optional(doc, "gap_move", version, where),
        ref_error=_optional(doc, "ref_error", version, where),
    )


def _optional(doc: dict, key: str, version: int, where: str) -> dict | None:
    """A version-2 field: absent from version 1 (None), present (maybe null) from version 2."""
    if version < 2:
        return None
    v = _need(doc, key, where)
    return None if v is None else dict(v)


def read_calibration(path: str | os.PathLike) -> Calibration:
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such calibration file (make one with `tracekit calibrate`)") from None
    except (OSError, ValueError) as e:
        raise TraceFormatError(f"{p}: unreadable calibration ({e})") from None
    return parse_calibration(doc, str(p))


def write_calibration(cal: Calibration, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p
