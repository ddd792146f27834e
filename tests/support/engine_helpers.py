"""HTTP helpers for the engine tests: plain aiohttp against a real server, no capture package."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "tiny.jsonl"
BF16_BASE = ("--dtype", "bf16", "--no-prefix-cache", "--slots", "8")


def fixture_prompts() -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json()


def greedy(prompt, max_tokens: int = 24, **extra) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        **extra,
    }


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
