"""The variant tags of `tracekit explain`: one type for what a rerun of a pair was.

A tag is stored as a string in each rerun's trace row (`params.explain.variant`) and in
explain.json: `alone:cold` (alone, prefix cache flushed), `alone` (alone, the cache could not be
flushed), `warm:B` (alone, the cache primed with the first B tokens), `burst` (with B's batch
mates). The capture side writes tags with `str(Variant)`; the analysis side reads them with
`Variant.parse`, never by splitting strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TraceFormatError

KINDS = ("alone:cold", "alone", "warm", "burst")


@dataclass(frozen=True)
class Variant:
    kind: str  # one of KINDS
    boundary: int | None = None  # warm: the primed prefix length (tokens)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or (self.kind == "warm") != (self.boundary is not None):
            raise TraceFormatError(f"explain variant {self.kind!r} (boundary {self.boundary}): not one of {KINDS}")

    def __str__(self) -> str:
        return f"warm:{self.boundary}" if self.kind == "warm" else self.kind

    @classmethod
    def parse(cls, text: str) -> "Variant":
        head, sep, arg = str(text).partition(":")
        if head == "warm" and sep:
            try:
                return cls("warm", int(arg))
            except ValueError:
                raise TraceFormatError(f"explain variant {text!r}: warm:B needs an integer B") from None
        return cls(str(text))

    @classmethod
    def alone_at(cls, boundary: int) -> "Variant | None":
        """The alone run at a reused-prefix boundary: cold at 0, warm:B above, None when unknown."""
        if boundary == 0:
            return cls("alone:cold")
        return cls("warm", boundary) if boundary > 0 else None

    @property
    def alone(self) -> bool:
        return self.kind != "burst"

    @property
    def boundary_wanted(self) -> int | None:
        """The reused prefix this variant asks of the engine (0 for cold; None when it cannot ask)."""
        return 0 if self.kind == "alone:cold" else self.boundary

    def to_params(self) -> dict:
        return {"variant": str(self)}

    @classmethod
    def from_params(cls, params: dict) -> "Variant":
        return cls.parse(params["variant"])


COLD = Variant("alone:cold")
ALONE = Variant("alone")
BURST = Variant("burst")
