"""Matrix runner: `tracekit run MATRIX.toml --out DIR` (docs/runner.md).

spec.py parses the TOML into cells; engines.py starts and stops each engine
configuration; cells.py captures the serial baseline and the concurrent burst
of every cell and runs lifecycle.py's checks; run.py is the library call
(`run(matrix, out, differ)`). The run directory's layout and records live in
tracekit/rundir.py. Never imports analyze: the caller passes the differ.
"""

from tracekit.rundir import Cell, CellRecord, Check

from .cells import run_matrix
from .run import Differ, RunResult, TeacherPlan, run
from .spec import Matrix, load_matrix

__all__ = [
    "Cell",
    "CellRecord",
    "Check",
    "Differ",
    "Matrix",
    "RunResult",
    "TeacherPlan",
    "load_matrix",
    "run",
    "run_matrix",
]
