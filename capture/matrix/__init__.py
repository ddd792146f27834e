"""Matrix runner: `tracekit run MATRIX.toml --out DIR` (docs/runner.md).

spec.py parses the TOML into cells; engines.py starts and stops each engine
configuration; cells.py captures the serial baseline and the concurrent burst
of every cell and runs lifecycle.py's checks; manifest.py hashes DIR.
Never imports analyze: `tracekit run` (the CLI) diffs each cell afterwards.
"""

from .cells import CHECKS_SCHEMA, CellOutcome, run_matrix
from .lifecycle import CheckResult
from .manifest import read_manifest, write_manifest
from .spec import Cell, Matrix, load_matrix

__all__ = [
    "CHECKS_SCHEMA",
    "Cell",
    "CellOutcome",
    "CheckResult",
    "Matrix",
    "load_matrix",
    "read_manifest",
    "run_matrix",
    "write_manifest",
]
