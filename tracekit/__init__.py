"""tracekit: differential trace and logit analysis for LLM serving engines.

The core package owns the trace format (schema, store), the errors, the CLI and
the reference engine. It never imports `capture` or `analyze` (only `cli` does).
"""

__version__ = "0.1.0"
