"""Start and stop one engine configuration (target x dtype x prefix cache) for a matrix run.

`serve` targets run `python -m tracekit serve --port 0 ARGS --dtype D
[--no-prefix-cache]` through `tracekit.engine.process.start_engine`;
`command` targets run any command line (placeholders {port} and {dtype}) and
poll `url + ready_path`; `url` targets are a running server that is only
polled for readiness. The engine's log goes to DIR/engines/<engine_id>.log
and its self-report (GET /v1/models) beside it; both stay, pass or fail.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tracekit.engine.process import EngineProcess, start_engine, wait_http_200
from tracekit.errors import EngineError
from tracekit.rundir import Cell, EngineRecord, RunDir

from .spec import Target


@dataclass
class RunningEngine:
    engine_id: str
    url: str
    command: list[str] | None  # None for a `url` target (not started by us)
    log_path: str | None
    proc: EngineProcess | None
    startup_s: float
    report: dict  # GET /v1/models once ready (self_report)

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc is not None else None

    def record(self, target: Target, exit_code: int | None) -> EngineRecord:
        return EngineRecord(
            self.engine_id,
            target.name,
            target.kind,
            RunDir.engine_log_rel(self.engine_id) if self.log_path else None,
            None if self.command is None else tuple(self.command),
            self.url,
            round(self.startup_s, 2),
            exit_code,
            self.report,
            None,
        )


def failed_record(t: Target, cell: Cell, error: str) -> EngineRecord:
    """The record of an engine that did not become ready (its log stays in engines/)."""
    log = None if t.kind == "url" else RunDir.engine_log_rel(cell.engine_id)
    return EngineRecord(cell.engine_id, t.name, t.kind, log, tuple(command_for(t, cell)), None, None, None, {}, error)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_for(t: Target, cell: Cell, port: int | None = None) -> list[str]:
    """The exact command line a cell's engine runs with (`serve` targets: the args after `tracekit serve`)."""
    dtype = str(t.dtype_map.get(cell.dtype, cell.dtype))
    cache = list(t.cache_on_args if cell.prefix_cache else t.cache_off_args)
    if t.kind == "tracekit":
        auth = ["--api-key-env", t.api_key_env] if t.api_key_env else []  # the variable's name, never its value
        return [*t.args, "--dtype", dtype, *cache, *([] if cell.prefix_cache else ["--no-prefix-cache"]), *auth]
    return [a.format(port=port, dtype=dtype) for a in t.args] + cache


def start(t: Target, cell: Cell, log_dir: Path, ready_timeout_s: float) -> RunningEngine:
    """Start (or, for a `url` target, wait for) the engine of `cell`. Raises EngineError."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = str(log_dir / f"{cell.engine_id}.log")
    t0 = time.perf_counter()
    if t.kind == "url":
        url = t.url.rstrip("/")
        if not wait_http_200(url + t.ready_path, time.monotonic() + ready_timeout_s):
            raise EngineError(f"{url}{t.ready_path} did not answer 200 within {ready_timeout_s:g} s")
        report = self_report(url, t.api_key())
        return RunningEngine(cell.engine_id, url, None, None, None, time.perf_counter() - t0, report)
    env = {**os.environ, **{k: str(v) for k, v in t.env.items()}}
    if t.kind == "tracekit":
        eng = start_engine(command_for(t, cell), timeout_s=ready_timeout_s, log_path=log, env=env)
    else:
        port = _free_port()
        cmd = command_for(t, cell, port)
        eng = EngineProcess.from_command(cmd, t.url.format(port=port), t.ready_path, ready_timeout_s, log, env)
    startup_s = time.perf_counter() - t0
    report = self_report(eng.url, t.api_key())
    return RunningEngine(cell.engine_id, eng.url, list(eng.command), log, eng, startup_s, report)


def self_report(url: str, api_key: str | None = None) -> dict:
    """GET /v1/models (the engine's own description); {"error": ...} when it has none."""
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return {"status": r.status, "v1_models": json.loads(r.read())}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
