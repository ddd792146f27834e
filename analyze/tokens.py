"""Token decoding for reports: a `tokenizers` tokenizer (not transformers, to
keep analysis light) from --tokenizer DIR or the run metadata's `tokenizer`."""

from __future__ import annotations

import os
from typing import Callable, Mapping

from tracekit.errors import ConfigError


def load_decoder(tokenizer_dir: str | None, run: Mapping | None = None,
                 required: bool = False) -> Callable[[int], str] | None:
    """A function id -> text, or None when no tokenizer is known (and not required)."""
    d = tokenizer_dir or (run or {}).get("tokenizer")
    if not d:
        if required:
            raise ConfigError("no tokenizer: the trace's run metadata names none; pass --tokenizer DIR")
        return None
    path = os.path.join(os.fspath(d), "tokenizer.json") if os.path.isdir(d) else os.fspath(d)
    if not os.path.exists(path):
        if tokenizer_dir or required:
            raise ConfigError(f"{path}: no tokenizer.json there; pass --tokenizer DIR (a directory with "
                              "tokenizer.json)")
        return None   # metadata points at a tokenizer on another machine: show ids only
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0][:120]})") from None
    return lambda i: tok.decode([int(i)], skip_special_tokens=False) if i >= 0 else ""
