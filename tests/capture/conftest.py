"""Fixtures for the capture tests."""

from __future__ import annotations

import pytest
from support.capture_helpers import write_prompts

from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402


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
