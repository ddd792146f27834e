"""Pitfalls of a capture: what makes its evidence weaker than it looks, said at capture time.

Each pitfall is one `warning:` line on stderr, said once a run, and recorded in the run
metadata under `pitfalls` ([{code, message}]) so that reports show it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Pitfall:
    code: str
    message: str

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message}


class Pitfalls:
    """The run's pitfalls, in the order found; callable as `warn(code, message)`."""

    def __init__(self, out=None):
        self.out = out
        self.found: dict[str, Pitfall] = {}

    def __call__(self, code: str, message: str) -> None:
        if code in self.found:
            return
        self.found[code] = Pitfall(code, message)
        print(f"warning: {message}", file=self.out or sys.stderr)

    def as_list(self) -> list[dict]:
        return [p.as_dict() for p in self.found.values()]
