"""Fixtures for the reference-engine tests: real `tracekit serve` processes on 127.0.0.1:0.

`engine_factory(*args)` starts an engine with `tracekit.engine.process.start_engine`,
once per argument tuple for the whole session (engine starts dominate the run
time), and stops them all at the end. Tests sharing an engine use unique
prompts or counter deltas, never absolute state. HTTP helpers live in
tests/support/engine_helpers.py (`conftest` names clash across test folders).
"""

from __future__ import annotations

import pytest
from support.engine_helpers import BF16_BASE, fixture_prompts, greedy, run_serial

from tracekit.engine.process import start_engine  # noqa: E402

# One torch thread per engine: the CI box has 2 cores shared with the test process.
BASE_ARGS = ("--threads", "1")


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory):
    started = {}

    def get(*args: str):
        key = tuple(args)
        if key not in started:
            log = tmp_path_factory.mktemp("engine") / "engine.log"
            started[key] = start_engine([*BASE_ARGS, *args], timeout_s=120, log_path=str(log))
        return started[key]

    yield get
    for eng in started.values():
        eng.terminate()
    for eng in started.values():
        eng.stop()


@pytest.fixture(scope="session")
def engine(engine_factory):
    """The default engine: fixture model, FP32, 4 slots, prefix cache on."""
    return engine_factory()


@pytest.fixture(scope="session")
def bf16_baseline(engine_factory) -> list[list[int]]:
    """Serial BF16 token ids without prefix reuse, 64 greedy tokens per fixture prompt."""
    eng = engine_factory(*BF16_BASE)
    return [
        r["choices"][0]["token_ids"] for r in run_serial(eng.url, [greedy(p["prompt"], 64) for p in fixture_prompts()])
    ]
