"""Helpers shared by the capture tests (`support.capture_helpers`)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from tracekit.store import TraceReader

TOKENIZER = str(Path(__file__).resolve().parents[2] / "fixtures" / "transcripts" / "tokenizer")


def write_prompts(path: Path, prompts: list) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return str(path)


def wait_ok_rows(out: Path, proc: subprocess.Popen, keys: set[str], timeout: float = 60.0) -> None:
    """Until the running capture's trace holds an ok row for each key (its writer flushed them).
    Polls the file (a live trace opens for reading while its writer runs); AssertionError after
    `timeout` s or when the capture exits first: a hang or a crash, never a slow machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists():
            try:
                with TraceReader(out) as r:
                    have = {r.requests.key[i] for i in range(len(r)) if r.requests.status[i] == "ok"}
            except Exception:  # created but not yet readable: the writer is starting
                have = set()
            if keys <= have:
                return
        time.sleep(0.05)
    raise AssertionError(f"{out}: ok rows {sorted(keys)} not written (capture exit code {proc.poll()})")


def sigint_default() -> None:
    """Popen's preexec_fn for a child that a test will Ctrl-C: SIGINT back to its default, so that
    Python installs its KeyboardInterrupt handler there. A shell without job control starts
    background jobs (`pytest ... &`) with SIGINT ignored, and children inherit an ignored signal:
    the SIGINT tests then waited 60 s on a child that never saw it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
