"""The live engines `tracekit explain` reruns a matrix cell's flips on.

For a cell of a `tracekit run` directory: its own configuration (same target,
dtype and prefix-cache setting, in a fresh process: the run's engines are gone
by then) and the configurations the target names in its matrix file
(`[target.variants.deterministic]`, `[target.variants.fp32]`, capture/matrix/spec.py),
each started by the matrix runner's `engines.start` with its log under `log_dir`.
A variant that does not start is left out with the reason (explain then says
that configuration was not run); the cell's own engine not starting is an error.
Nothing here sends a variant request: that is `variants.run_variants`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.errors import EngineError
from tracekit.rundir import Cell, EngineRecord
from tracekit.text import clip

from ..matrix.engines import RunningEngine, start
from ..matrix.spec import Matrix, Target

CONFIG_VARIANTS = ("deterministic", "fp32")  # explain's configurations besides "engine"


@dataclass
class ConfigEngines:
    """The started engines of one cell's configurations."""

    urls: dict[str, str]  # config ("engine", "deterministic", "fp32") -> base URL
    running: list[tuple[Target, RunningEngine]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # variants that did not start, and why

    def stop(self) -> list[EngineRecord]:
        """Stop every engine; their records (command line, self-report, exit code) for the manifest."""
        return [eng.record(t, eng.stop()) for t, eng in self.running]


def configurations(m: Matrix, cell: Cell) -> list[tuple[str, Target, Cell]]:
    """(config, target, cell in that configuration's dtype) of the cell's engine and of each
    variant its target names. The variant's cell carries the variant target's name, so its
    engine id (and log file) is its own: `ref-deterministic.bf16.cache-on`."""
    t = m.target(cell.target)
    out = [("engine", t, cell)]
    for name in CONFIG_VARIANTS:
        v = t.variant(name, cell.dtype)
        if v is not None:
            vt, dtype = v
            out.append((name, vt, dataclasses.replace(cell, target=vt.name, dtype=dtype)))
    return out


def start_configs(m: Matrix, cell: Cell, log_dir: Path, ready_timeout_s: float | None = None) -> ConfigEngines:
    """Start the cell's configurations one after the other, from this thread: an engine gets
    SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG, tracekit/engine/process.py),
    so a pool thread would take its engine with it. Raises EngineError when the cell's own
    engine does not start."""
    timeout = ready_timeout_s if ready_timeout_s is not None else m.settings.ready_timeout_s
    got = ConfigEngines({})
    for name, t, c in configurations(m, cell):
        try:
            eng = start(t, c, log_dir, timeout)
        except EngineError as e:
            if name == "engine":
                got.stop()
                raise
            got.notes.append(f"{name} configuration ({t.name}): did not start: {clip(str(e), 200)}")
            continue
        got.running.append((t, eng))
        got.urls[name] = eng.url
    return got
