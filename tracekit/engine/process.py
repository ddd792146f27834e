"""Start an engine in a subprocess and wait until it serves: for tests, benches and runners.

Stable API (other packages import it):

    start_engine(args=(), timeout_s=120, log_path=None, env=None) -> EngineProcess
        Runs `python -m tracekit serve --port 0 *args` from the repository
        root, reads the `tracekit serve: listening on http://HOST:PORT` line
        from its stderr, then polls GET /health until 200. Raises EngineError
        (with the log's tail) if the process exits or times out first.

    EngineProcess.from_command(cmd, url, ready_path="/health", timeout_s=600, log_path=None, env=None)
        Any other engine command line (vLLM, llama.cpp, ...) whose URL you
        already know: starts it and polls url + ready_path until 200.

    wait_http_200(url, deadline, alive=lambda: True) -> bool
        The one readiness loop: GET url until 200; also for servers started elsewhere.

    EngineProcess: .url ("http://127.0.0.1:PORT", no trailing slash), .port,
        .pid, .log_path (stdout+stderr of the engine), .command, .stop(timeout_s=10)
        (SIGTERM, then SIGKILL; returns the exit code), .terminate() (SIGTERM, no wait),
        .alive(), .log_tail(n). A context manager: `with start_engine([...]) as eng:`.

Imports nothing heavy (no torch, no aiohttp): readiness is polled with urllib.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import EngineError

REPO_ROOT = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    """Linux: the engine gets SIGTERM when the process that started it dies, so a
    killed test run or `tracekit run` never leaves engines holding cores (seen
    here: eleven orphaned engines after a CI run was killed)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_http_200(url: str, deadline: float, alive=lambda: True) -> bool:
    """GET url every 0.1 s until it answers 200 (True), or alive() is False or time.monotonic()
    passes deadline (False). The one readiness loop (engines started here, and running servers)."""
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


LISTEN_RE = re.compile(r"tracekit serve: listening on (http://[\w.\-\[\]:]+?):(\d+)\s*$")


class EngineProcess:
    def __init__(self, proc: subprocess.Popen, command: list[str], log_path: str, url: str | None = None):
        self.proc, self.command, self.log_path = proc, command, log_path
        self.url = url.rstrip("/") if url else None

    @property
    def port(self) -> int | None:
        m = re.search(r":(\d+)$", self.url or "")
        return int(m.group(1)) if m else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @classmethod
    def spawn(cls, cmd: list[str], log_path: str | None, env: dict | None, url: str | None = None):
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="tracekit-engine-", suffix=".log")
            os.close(fd)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        return cls(proc, cmd, log_path, url)

    @classmethod
    def from_command(
        cls,
        cmd: list[str],
        url: str,
        ready_path: str = "/health",
        timeout_s: float = 600,
        log_path: str | None = None,
        env: dict | None = None,
    ) -> "EngineProcess":
        """Start any engine command line and wait until url + ready_path answers 200."""
        eng = cls.spawn(list(cmd), log_path, env, url)
        eng._wait_ready(ready_path, time.monotonic() + timeout_s)
        return eng

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _fail(self, why: str):
        self.stop()
        raise EngineError(f"engine {' '.join(self.command[:6])}...: {why}; log {self.log_path}:\n{self.log_tail()}")

    def _wait_listen(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                self._fail(f"exited with code {self.proc.returncode} before listening")
            for line in Path(self.log_path).read_text(errors="replace").splitlines():
                m = LISTEN_RE.search(line)
                if m:
                    self.url = f"{m.group(1)}:{m.group(2)}"
                    return
            time.sleep(0.05)
        self._fail("did not print its listening address in time")

    def _wait_ready(self, ready_path: str, deadline: float) -> None:
        if wait_http_200(self.url + ready_path, deadline, self.alive):
            return
        if not self.alive():
            self._fail(f"exited with code {self.proc.returncode} before becoming ready")
        self._fail(f"{self.url}{ready_path} did not answer 200 in time")

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop several engines at once, then stop() each)."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10) -> int | None:
        """SIGTERM the engine's process group, SIGKILL after timeout_s. Returns the exit code."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        return self.proc.returncode

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engine(
    args=(), timeout_s: float = 120, log_path: str | None = None, env: dict | None = None
) -> EngineProcess:
    """Start `python -m tracekit serve --port 0 *args`; return once /health answers 200."""
    env = dict(os.environ if env is None else env)
    # The checkout must be importable even when tracekit is not installed (GPU image).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tracekit", "serve", "--port", "0", *map(str, args)]
    eng = EngineProcess.spawn(cmd, log_path, env)
    deadline = time.monotonic() + timeout_s
    eng._wait_listen(deadline)
    eng._wait_ready("/health", deadline)
    return eng
