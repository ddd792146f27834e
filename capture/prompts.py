"""Prompt sets: JSONL, one object a line (docs/capture.md).

    {"id": "p0", "prompt": "text" | [token ids], "max_tokens": 32, "ignore_eos": true,
     "top_logprobs": 20, "temperature": 0.0, "extra": {...body fields...}, "meta": {...}}

Only `id` and `prompt` are required; the optional fields override the command
line for that request; `extra` is merged into the request body as-is (engine
specific fields such as `stop` or `seed`); `meta` is free-form and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.errors import ConfigError

OPTIONAL = {
    "max_tokens": int,
    "ignore_eos": bool,
    "top_logprobs": int,
    "temperature": (int, float),
    "extra": dict,
    "meta": dict,
}


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str | list[int]
    overrides: dict = field(default_factory=dict)  # max_tokens / ignore_eos / top_logprobs / temperature
    extra: dict = field(default_factory=dict)


def _parse_line(obj: object, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
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
    unknown = set(obj) - {"id", "prompt"} - set(OPTIONAL)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {sorted(unknown)}; allowed: id, prompt, "
            f"{', '.join(OPTIONAL)} (engine-specific body fields go under 'extra')"
        )
    for name, typ in OPTIONAL.items():
        if name in obj and (not isinstance(obj[name], typ) or (typ is int and isinstance(obj[name], bool))):
            raise ConfigError(f"{where}: '{name}' has the wrong type ({type(obj[name]).__name__})")
    overrides = {k: obj[k] for k in ("max_tokens", "ignore_eos", "top_logprobs", "temperature") if k in obj}
    return Prompt(pid, prompt, overrides, dict(obj.get("extra") or {}))


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read and validate a JSONL prompt set; ids must be unique."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the prompt set ({e.strerror})") from None
    out: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
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
