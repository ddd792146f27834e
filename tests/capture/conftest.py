"""Shared helpers for the capture tests: prompt files and a capture runner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from capture.http import CaptureConfig, run_capture  # noqa: E402

TOKENIZER = str(Path(__file__).resolve().parents[2] / "fixtures" / "transcripts" / "tokenizer")


def write_prompts(path: Path, prompts: list) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return str(path)


@pytest.fixture
def capture_to(tmp_path):
    """capture_to(url, prompts, **options) -> (summary, out path)."""
    def run(url, prompts, name="run.h5", **kw):
        pfile = write_prompts(tmp_path / (name + ".jsonl"), prompts)
        out = tmp_path / name
        kw.setdefault("top_logprobs", 5)
        kw.setdefault("max_tokens", 12)
        kw.setdefault("progress", False)
        return run_capture(CaptureConfig(url=url, prompts=pfile, out=str(out), **kw)), out
    return run
