"""The launcher other packages use to start engines: failures are clear, from_command works."""

from __future__ import annotations

import socket
import sys

import pytest

from tracekit.engine.process import EngineProcess, start_engine
from tracekit.errors import EngineError


def test_start_engine_failure_names_the_cause(tmp_path):
    """A bad model directory must fail fast with the engine's own error line, not a timeout."""
    with pytest.raises(EngineError, match="not a model directory"):
        start_engine(["--model", str(tmp_path)], timeout_s=60)


def test_from_command_waits_for_ready_path():
    """from_command starts any command line and polls url + ready_path until 200; stop() ends it."""
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with EngineProcess.from_command(cmd, f"http://127.0.0.1:{port}", ready_path="/", timeout_s=30) as proc:
        assert proc.alive() and proc.port == port
    assert not proc.alive()
