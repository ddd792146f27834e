"""The launcher other packages use to start engines: failures are clear, from_command works."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tracekit.engine.process import REPO_ROOT, EngineProcess, start_engine
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


def test_pickled_weights_are_refused_with_one_line(tmp_path):
    """Models load from safetensors only (a pickle can run code when unpickled): a directory
    holding only pytorch_model.bin must be refused before anything is loaded, with one `Error:`
    line naming the file and exit 3, never a traceback."""
    import shutil
    import subprocess

    import torch

    tiny = Path(__file__).resolve().parents[3] / "fixtures" / "models" / "tiny"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp_path / name)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    proc = subprocess.run(
        [sys.executable, "-m", "tracekit", "serve", "--port", "0", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in proc.stderr
    assert "safetensors" in lines[0] and "pytorch_model.bin" in lines[0]
    assert proc.stdout == ""
