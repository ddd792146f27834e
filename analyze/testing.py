"""A pytest helper an engine's own test suite can import:

    from tracekit.analyze.testing import assert_equivalent
    assert_equivalent("serial.h5", "concurrent.h5", allow={"bf16_tie_flip", "post_eos"})

It fails (AssertionError, so pytest shows it as a test failure) when any pair
lands in a class outside `identical` + `allow`, listing each offending pair
with its rule and evidence.
"""

from __future__ import annotations

import os

from .classify import CLASSES


def assert_equivalent(a, b, allow: set[str] | frozenset[str] | tuple = (), max_listed: int = 20, **diff_kwargs):
    """Diff b against a; raise AssertionError listing the pairs whose class is not allowed.

    `a`/`b` are paths or TraceReaders; `diff_kwargs` go to tracekit.analyze.diff
    (thresholds, selections, eos). Returns the DiffResult when it passes.
    """
    from .compare import diff

    allow = set(allow)
    unknown = allow - set(CLASSES)
    if unknown:
        raise ValueError(f"allow: unknown classes {sorted(unknown)}; valid: {', '.join(CLASSES)}")
    result = diff(a, b, **diff_kwargs)
    ok = allow | {"identical"}
    bad = [p for p in result.pairs if p.cls not in ok]
    if bad:
        from .diff_report import summary_line

        lines = [
            f"{len(bad)} pair(s) of {os.fspath(result.b)} vs {os.fspath(result.a)} not in "
            f"{sorted(ok)}: {summary_line(result)}"
        ]
        for p in bad[:max_listed]:
            lines.append(f"  {p.key}: {p.cls} at {p.position} (A {p.token_a} / B {p.token_b}): {p.rule}")
        if len(bad) > max_listed:
            lines.append(f"  ... and {len(bad) - max_listed} more")
        raise AssertionError("\n".join(lines))
    return result
