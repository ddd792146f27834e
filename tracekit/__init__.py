"""tracekit: differential trace and logit analysis for LLM serving engines.

One installed namespace over the card's folders (pyproject's `package-dir`):

    tracekit            tracekit/    the core: trace format (schema, store), errors, dtypes,
                                     run metadata, the run directory, the reference engine
    tracekit.capture    capture/     HTTP capture, teacher-forced diagnostic, matrix runners
    tracekit.analyze    analyze/     alignment, classification, statistics, reports, plots
    tracekit.workflows  workflows/   orchestration that needs both (the matrix run, explain, demo)
    tracekit.cli        cli/         the thin command line on top

The core never imports a floor above it. In a source checkout that is not installed
(`PYTHONPATH=.` on a machine where nothing may be installed), the four upper packages
are found beside this folder by `_CheckoutFinder`; an installed tracekit never needs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

# subpackage -> its folder, relative to the repository root (mirrors pyproject's package-dir)
FOLDERS = {"capture": "capture", "analyze": "analyze", "workflows": "workflows", "cli": "cli"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `tracekit.<sub>` for the FOLDERS of a source checkout; everything else is left to Python."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        head, _, sub = fullname.partition(".")
        if head != __name__ or sub not in FOLDERS:
            return None
        folder = self.root / FOLDERS[sub]
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _install_checkout_finder() -> None:
    here = Path(__file__).resolve().parent
    if all((here / sub).is_dir() for sub in FOLDERS):
        return  # an installed wheel: the subpackages live inside this folder
    root = here.parent
    if not all((root / folder / "__init__.py").is_file() for folder in FOLDERS.values()):
        return  # installed without the checkout beside it: setuptools' own mapping applies
    if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder(root))


_install_checkout_finder()
