"""`--help` text as printed: the per-mode prefix ("HTTP: ...") must not lower-case an acronym
(issue 24 item 17: `capture --help` said "sSE streaming")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_capture_help_keeps_acronyms():
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "capture", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "HTTP: SSE streaming." in text
    bad = [w for w in re.findall(r"\b[a-z][A-Z]{2,}\w*", text) if w not in ("vLLM",)]  # vLLM is spelled so
    assert not bad, bad
    assert "Teacher-forced: write --full-logits" in text  # an ordinary first word is still lower-cased
