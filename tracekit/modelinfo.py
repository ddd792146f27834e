"""Facts about a model directory that several parts need, read from its files.

EOS ids: the one reader for every part (engine, capture, diagnostic, diff).
They come from generation_config.json, then config.json, then the
tokenizer's eos_token (tokenizer_config.json resolved through tokenizer.json);
the union of what the files say, never a guess. Reads JSON only; the
tokenizer, when needed, through `tokenizers` (no transformers, no torch).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError


def _ids(value) -> set[int]:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read as JSON ({e})") from None
    return doc if isinstance(doc, dict) else {}


def _tokenizer_eos(d: Path) -> set[int]:
    tc = d / "tokenizer_config.json"
    if not tc.is_file():
        return set()
    eos = _json(tc).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    tj = d / "tokenizer.json"
    if not isinstance(eos, str) or not tj.is_file():
        return set()
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(str(tj)).token_to_id(eos)
    return set() if tid is None else {int(tid)}


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Sorted EOS ids that the model directory's own files state; () when none do."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory (expected a model or tokenizer directory)")
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = d / name
        if p.is_file():
            ids |= _ids(_json(p).get("eos_token_id"))
    ids |= _tokenizer_eos(d)
    return tuple(sorted(ids))
