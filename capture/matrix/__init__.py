"""Matrix runner: `tracekit run MATRIX.toml --out DIR` (docs/runner.md).

spec.py parses the TOML into cells; engines.py starts and stops each engine
configuration; cells.py captures the serial baseline and the concurrent burst
of every cell and runs lifecycle.py's checks. The whole run (capture, diff, the
teacher-forced step, the manifest) is `tracekit.workflows.matrix.run`, a floor up:
capture never imports analyze. The run directory's layout and records live in
tracekit/rundir/.
"""

from tracekit.rundir import Cell, CellRecord, Check

from .cells import run_matrix
from .spec import Matrix, load_matrix

__all__ = [
    "Cell",
    "CellRecord",
    "Check",
    "Matrix",
    "load_matrix",
    "run_matrix",
]
