"""`python -m tracekit.cli ...` (and `python -m tracekit ...`, which runs this): the command line."""

from tracekit.cli import main

main()
