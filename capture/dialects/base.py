"""What every dialect shares: the request spec, the Protocol a dialect implements and
the small helpers of the OpenAI-shaped ones.

A dialect turns one engine's JSON into appends on an `Acc` (acc.py: plain Python
lists, a few appends per token); `Acc.columns()` builds the numpy `TokenColumns` once
per request at the end. Nothing here does I/O: the client owns the socket, the run
loop owns the trace writer. A response of a shape a dialect does not know raises
`ResponseShapeError` from an explicit check, never a stray KeyError or TypeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tracekit.errors import ResponseShapeError
from tracekit.text import clip

from .acc import Acc


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt` is text or token ids; `extra` holds
    per-request parameters from the prompt file, merged into the body last."""

    key: str
    prompt: str | list[int]
    max_tokens: int
    top_logprobs: int
    ignore_eos: bool
    stream: bool
    model: str = ""
    temperature: float = 0.0
    extra: dict = field(default_factory=dict)
    # llama.cpp's per-request `cache_prompt`: None sends nothing (the server's --cache-prompt /
    # --no-cache-prompt decides); True / False asks for prefix reuse or a cold prompt.
    cache_prompt: bool | None = None


class EngineErrorEvent(Exception):
    """An error object inside a 200 stream or body (the message is the excerpt)."""


class Dialect(Protocol):
    """One engine's wire format. Implementations are small modules; see
    capture/dialects/__init__.py for the table."""

    name: str
    done_marker: bool  # the stream ends with `data: [DONE]` (a stream without it is cut)

    def route(self, stream: bool) -> str: ...

    def body(self, spec: RequestSpec) -> dict[str, Any]: ...

    bad_status: int  # the HTTP status the engine answers bad_body with (400; TGI 422)

    def bad_body(self, spec: RequestSpec) -> dict[str, Any]:
        """spec's body with its token-limit field set to a non-numeric string: a wrong-typed
        field that every engine of the dialect validates before generating anything (the
        runner's `bad_request` check). A negative limit is not: llama.cpp takes -1 as "no
        limit", SGLang's and TGI's routes do not read `max_tokens` at all."""

    def parse_response(self, obj: dict, acc: Acc, t: float) -> None:
        """A whole non-stream body; every token gets arrival time t."""

    def parse_event(self, obj: dict, acc: Acc, t: float) -> None:
        """One stream event; sets acc.done when it is the dialect's last event."""


BAD_VALUE = "many"  # a token limit no engine parses as an integer


def check_error(obj: Any) -> None:
    """Raise EngineErrorEvent for an `{"error": ...}` object (OpenAI, vLLM, TGI, llama.cpp)."""
    if type(obj) is dict and "error" in obj and obj["error"]:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise EngineErrorEvent(clip(str(msg), 500))
    if type(obj) is not dict:
        raise ResponseShapeError(f"expected a JSON object, got {type(obj).__name__}")


def usage_into(usage: Any, acc: Acc) -> None:
    """OpenAI `usage`: prompt_tokens_details.cached_tokens (absent means unknown: leave -1,
    never write 0)."""
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        acc.cached_tokens = details["cached_tokens"]
