"""User-facing errors. Messages say what failed, where, and what to do next.

The CLI prints `Error: <message>` on stderr and exits 3 for any TracekitError;
usage errors (click's, and UsageError raised by the library for a bad option value) exit 2;
any other exception is an internal error (exit 3,
one line; the traceback with `tracekit --debug` or TRACEKIT_DEBUG=1); exit 1 is
reserved for "divergence found / checks failed", which is a result, not an error.
"""


class TracekitError(Exception):
    """Base of every error the CLI reports as one line (exit 3)."""


class ConfigError(TracekitError):
    """A bad option, matrix file, prompt set or model directory."""


class UsageError(ConfigError):
    """The command line itself is wrong (a bad option value, a missing input file, the same file
    twice, directories that cannot be merged): one line, exit 2 like click's own usage errors."""


class TraceFormatError(TracekitError):
    """A file that is not a tracekit trace, or is corrupt or incomplete."""


class SchemaVersionError(TraceFormatError):
    """A trace written by a format version this reader cannot read."""


class CaptureError(TracekitError):
    """A capture could not run (server unreachable, no request could be sent)."""


class StreamProtocolError(CaptureError):
    """A response stream broke its protocol (cut event, bad JSON, error event)."""


class ResponseShapeError(StreamProtocolError):
    """Valid JSON from the engine, of a shape the dialect checked and does not know (a missing or
    wrong-typed field). Raised only by explicit checks: any other exception in a parser is a bug."""


class AlignmentError(TracekitError):
    """Two traces cannot be compared (nothing in common, mismatched tokenizers)."""


class EngineError(TracekitError):
    """The reference engine could not start or serve (bad model, bad option)."""
