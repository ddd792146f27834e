"""llama.cpp's `llama-server` for tracekit's integration tests and engine checks: find the binary,
convert the fixture model, start a server on a free port of 127.0.0.1 and wait until it serves.

    from llamacpp import server_binary, tiny_gguf, start_server
    with start_server(server_binary(), tiny_gguf(tmp_dir), slots=4) as eng:
        ... eng.url ...

The binary comes from `TRACEKIT_LLAMA_SERVER`, or from scripts/build_llama_server.sh's cache when
it was built there. Launch flags for the best evidence (docs/engines.md): `--metrics` (counters for
the lifecycle checks), `-np N` slots, `-ctk f32 -ctv f32 -fa off` with an f32 GGUF for numerics
that do not depend on batch composition beyond what the engine really does, `-t 2` threads.
It does not build anything (build_llama_server.sh does) and knows nothing about captures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.engine.process import EngineProcess, wait_http_200  # noqa: E402
from tracekit.errors import EngineError  # noqa: E402

TINY = ROOT / "fixtures" / "models" / "tiny"
VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp build_llama_server.sh builds
LISTEN_RE = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
# The flags of docs/engines.md: f32 KV cache, no flash attention, metrics on.
EVIDENCE_FLAGS = ("-ctk", "f32", "-ctv", "f32", "-fa", "off", "--metrics")


def server_binary() -> str | None:
    """TRACEKIT_LLAMA_SERVER, else the build script's cached binary, else None."""
    env = os.environ.get("TRACEKIT_LLAMA_SERVER")
    if env:
        return env
    cache = Path(os.environ.get("TRACEKIT_CACHE", Path.home() / ".cache" / "tracekit"))
    built = cache / "llama-server" / VERSION / "llama-server"
    return str(built) if os.access(built, os.X_OK) else None


def tiny_gguf(out_dir: Path, outtype: str = "f32") -> Path:
    """The fixture model as a GGUF in out_dir (converted once; the file is reused)."""
    out = Path(out_dir) / f"tiny-{outtype}.gguf"
    if not out.exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "convert_tiny_to_gguf.py"),
                str(TINY),
                str(out),
                "--outtype",
                outtype,
            ],
            check=True,
            capture_output=True,
        )
    return out


def start_server(
    binary: str,
    gguf: Path,
    slots: int = 4,
    ctx: int = 4096,
    extra: tuple[str, ...] = EVIDENCE_FLAGS,
    log_path: str | None = None,
    timeout_s: float = 120.0,
) -> EngineProcess:
    """`llama-server -m GGUF --port 0 -np SLOTS ...`; returns once GET /health answers 200 (the
    model is loaded). The port is read from the server's own `listening on` log line."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", "0", "-np", str(slots), "-c", str(ctx)]
    cmd += ["-t", "2", *extra]
    eng = EngineProcess.spawn(cmd, log_path, dict(os.environ))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and eng.alive():
        m = LISTEN_RE.search(Path(eng.log_path).read_text(errors="replace"))
        if m:
            eng.url = m.group(1)
            break
        time.sleep(0.05)
    if eng.url is None or not wait_http_200(eng.url + "/health", deadline, eng.alive):
        eng._fail("llama-server did not come up (no 'listening on' line or no /health 200)")
    return eng


__all__ = ["EVIDENCE_FLAGS", "EngineError", "server_binary", "start_server", "tiny_gguf"]
