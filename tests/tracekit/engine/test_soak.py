"""A short soak (bench/soak.py's own code, 60 requests): clients that vanish and malformed bodies
among good requests; nothing is lost, nothing leaks, nothing is logged as a crash.

Disconnect moments are counted in stream events (or right after sending), never in seconds, and
the end state is awaited on /metrics (the hang bound is not a timing assumption).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[3] / "bench" / "soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("tracekit_bench_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_short_soak_loses_nothing_and_leaks_nothing(engine):
    """60 requests at concurrency 16 on a 4-slot engine: every good request completes with the
    serial reference's tokens, every malformed one gets its 4xx, every dropped client's slot comes
    back (the engine ends idle), the engine stays up and logs no traceback (a write racing a
    disconnect used to)."""
    soak = _soak_module()
    res = asyncio.run(soak.soak(engine.url, engine.pid, engine.log_path, 60, 16, seed=3))
    assert res["problems"] == []
    assert res["disconnects"].get("drop_after_events", 0) > 0 and res["disconnects"].get("close_after_send", 0) > 0
    assert res["sent"] == 60 and res["completed"] + res["cancelled"] + res["bad_inputs"] == 60
    assert res["lost"] == 0 and res["mismatched"] == 0
    assert res["bad_inputs_rejected"] == res["bad_inputs"] > 0
    assert res["leaked_slots"] == 0 and res["running_after"] == 0 and res["waiting_after"] == 0
    assert res["engine_alive"] and res["tracebacks_in_log"] == 0
