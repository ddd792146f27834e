"""Token decoding for reports: a `tokenizers` tokenizer (not transformers, to
keep analysis light) from --tokenizer DIR or the run metadata's `tokenizer`."""

from __future__ import annotations

import os
from typing import Callable

from tracekit.errors import ConfigError
from tracekit.runrecord import RunRecord


def load_decoder(
    tokenizer_dir: str | None, run: RunRecord | None = None, required: bool = False
) -> Callable[[int], str] | None:
    """A function id -> text, or None when no tokenizer is known (and not required)."""
    if tokenizer_dir:
        d = os.fspath(tokenizer_dir)
        path = os.path.join(d, "tokenizer.json") if os.path.isdir(d) else d
        if not os.path.isfile(path):
            raise ConfigError(
                f"{path}: no tokenizer.json there; pass --tokenizer DIR (a directory with tokenizer.json)"
            )
    else:
        # The run's tokenizer, else its model directory when it holds tokenizer.json
        # (teacher-forced traces name the model). A path from another machine: ids only.
        rec = run or RunRecord()
        guesses = [os.path.join(d, "tokenizer.json") for d in (rec.tokenizer, rec.model_dir, rec.model) if d]
        path = next((g for g in guesses if os.path.isfile(g)), None)
        if path is None:
            if required:
                raise ConfigError(
                    "no tokenizer: the trace's run metadata names none that exists here; pass --tokenizer DIR"
                )
            return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0][:120]})") from None
    return lambda i: tok.decode([int(i)], skip_special_tokens=False) if i >= 0 else ""
