"""`python -m tracekit ...`: the console script's twin.

A launcher, not a dependency: it runs the top floor (`tracekit.cli`) by name, so
the core package imports nothing above it."""

import runpy

runpy.run_module("tracekit.cli", run_name="__main__", alter_sys=True)
