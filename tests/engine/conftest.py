"""Fixtures for the reference-engine tests: real `tracekit serve` processes on 127.0.0.1:0.

`engine_factory(*args)` starts an engine with `tracekit.engine.process.start_engine`,
once per argument tuple for the whole session (engine starts dominate the run
time), and stops them all at the end. Tests sharing an engine use unique
prompts or counter deltas, never absolute state.
Helpers here talk plain HTTP with aiohttp: no capture package, no mocks.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from tracekit.engine.process import start_engine

PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "tiny.jsonl"
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


BF16_BASE = ("--dtype", "bf16", "--no-prefix-cache", "--slots", "8")


@pytest.fixture(scope="session")
def bf16_baseline(engine_factory) -> list[list[int]]:
    """Serial BF16 token ids without prefix reuse, 64 greedy tokens per fixture prompt."""
    eng = engine_factory(*BF16_BASE)
    return [r["choices"][0]["token_ids"] for r in run_serial(eng.url, [greedy(p["prompt"], 64)
                                                                       for p in fixture_prompts()])]


def fixture_prompts() -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json()


def greedy(prompt, max_tokens: int = 24, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **extra}


async def _serial(url: str, bodies: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        out = []
        for b in bodies:
            status, js = await complete(s, url, b)
            assert status == 200, js
            out.append(js)
        return out


async def _concurrent(url: str, bodies: list[dict], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one(b):
            async with sem:
                status, js = await complete(s, url, b)
                assert status == 200, js
                return js
        return list(await asyncio.gather(*(one(b) for b in bodies)))


def run_serial(url: str, bodies: list[dict]) -> list[dict]:
    return asyncio.run(_serial(url, bodies))


def run_concurrent(url: str, bodies: list[dict], concurrency: int = 8) -> list[dict]:
    return asyncio.run(_concurrent(url, bodies, concurrency))


def metric(url: str, name: str) -> float:
    """One unlabelled sample from /metrics."""
    async def get():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
            return await r.text()
    for line in asyncio.run(get()).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
