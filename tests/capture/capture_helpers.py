"""Helpers shared by the capture tests (a uniquely named module: `conftest` is ambiguous
with the teacher tests' conftest on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER = str(Path(__file__).resolve().parents[2] / "fixtures" / "transcripts" / "tokenizer")


def write_prompts(path: Path, prompts: list) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return str(path)
