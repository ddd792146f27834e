"""Prompt sets: JSONL, one object a line (docs/capture.md). The one parser for the HTTP
capture, the teacher-forced diagnostic and the matrix runner.

    {"id": "p0", "prompt": "text" | [token ids], "max_tokens": 32, "ignore_eos": true,
     "top_logprobs": 20, "temperature": 0.0, "extra": {...body fields...}, "meta": {...}}

Only `id` and `prompt` are required. The optional sampling fields apply to that prompt
where the command line does not set them (`--max-tokens` given on the command line wins;
capture says so on stderr when the two differ); `extra` is merged into the request body
as-is (engine specific fields such as `stop` or `seed`); `meta` is free-form and ignored.
Every error names the file and line and is one `ConfigError` line, never a traceback.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.errors import ConfigError, UsageError

DEFAULT_MAX_TOKENS = 32  # tokens a request generates when neither the command line nor the prompt says
OVERRIDES = {  # sampling fields a prompt may set for itself
    "max_tokens": int,
    "ignore_eos": bool,
    "top_logprobs": int,
    "temperature": (int, float),
}
OPTIONAL = {**OVERRIDES, "extra": dict, "meta": dict}
FIELDS = ("id", "prompt", *OPTIONAL)


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str | list[int]
    overrides: dict = field(default_factory=dict)  # the OVERRIDES fields the line sets
    extra: dict = field(default_factory=dict)


def _unknown_fields(obj: dict, where: str) -> None:
    unknown = sorted(set(obj) - set(FIELDS))
    if not unknown:
        return
    hints = [f"{u!r} -> {m[0]!r}?" for u in unknown if (m := difflib.get_close_matches(u, FIELDS, 1, 0.75))]
    raise ConfigError(
        f"{where}: unknown field(s) {unknown}"
        + (f" (did you mean {', '.join(hints)})" if hints else "")
        + f"; allowed: {', '.join(FIELDS)} (engine-specific body fields go under 'extra')"
    )


def _parse_line(obj: object, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    _unknown_fields(obj, where)  # first: a misspelled 'promt' is named, not reported as a missing 'prompt'
    pid, prompt = obj.get("id"), obj.get("prompt")
    if not isinstance(pid, str) or not pid:
        raise ConfigError(f"{where}: 'id' must be a non-empty string")
    if "#" in pid:
        raise ConfigError(f"{where}: id {pid!r} contains '#', which marks repeats in trace keys")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ConfigError(f"{where}: 'prompt' as a list must hold non-negative token ids")
    elif not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
    for name, text in (("id", pid), ("prompt", prompt)):
        if isinstance(text, str) and not _encodable(text):  # JSON's "\ud800": no UTF-8 text, no trace row
            raise ConfigError(f"{where}: '{name}' holds a lone surrogate escape ({text!r:.60}); fix the text")
    for name, typ in OPTIONAL.items():
        if name in obj and (not isinstance(obj[name], typ) or (typ is int and isinstance(obj[name], bool))):
            raise ConfigError(f"{where}: '{name}' has the wrong type ({type(obj[name]).__name__})")
    overrides = {k: obj[k] for k in OVERRIDES if k in obj}
    return Prompt(pid, prompt, overrides, dict(obj.get("extra") or {}))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lines(path: Path):
    """(line number, text) of the non-blank lines; a line that is not UTF-8 is a one-line error."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such prompt file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the prompt set ({e.strerror})") from None
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "save the prompt file as UTF-8 (JSON escapes like \\u00e9 work too)"
            ) from None
        if line.strip():
            yield n, line.removeprefix("\ufeff") if n == 1 else line


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read and validate a JSONL prompt set; ids must be unique."""
    path = Path(path)
    out: list[Prompt] = []
    seen: set[str] = set()
    for n, line in _lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        p = _parse_line(obj, f"{path}:{n}")
        if p.id in seen:
            raise ConfigError(f"{path}:{n}: duplicate id {p.id!r}")
        seen.add(p.id)
        out.append(p)
    if not out:
        raise ConfigError(f"{path}: the prompt set is empty")
    return out
