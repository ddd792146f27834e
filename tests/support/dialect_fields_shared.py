"""What the per-engine dialect field tests share (test_dialect_fields_vllm.py, _sglang.py, _tgi.py,
_llamacpp.py: one test per field each dialect reads, checked against the shapes in the engines'
own source).

The vLLM, SGLang and TGI transcripts are constructed from the response models of vLLM 0.33.0,
SGLang 0.5.23 and TGI v3.3.7 (fixtures/transcripts/README.md, "Constructed transcripts", cites
repository, file and commit); the llama.cpp ones are recordings of llama.cpp 0c1e570, whose
source is cited the same way. Every docstring names the source file a field was read from. A
field is checked through the real capture client against the replay server (a real socket,
random chunking), or, where the test must change one value the engine can send (a sampled
token, a tie, another finish reason), through the dialect's own parse function.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from support.capture_helpers import write_prompts
from support.replay import ReplayServer, load, routes_for
from tracekit.capture.dialects import Acc, get
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.capture.sse import SSEDecoder
from tracekit.store import TraceReader

# The 12 greedy tokens, top-5, that every transcript carries (llama-server's recording).
_SRC = json.loads(load("llamacpp-server__completion__nonstream.http").body)["completion_probabilities"]
IDS = [e["id"] for e in _SRC]
LPS = np.array([e["logprob"] for e in _SRC], np.float32)
TOP_IDS = np.array([[t["id"] for t in e["top_logprobs"]] for e in _SRC], np.int32)
TOP_LPS = np.array([[t["logprob"] for t in e["top_logprobs"]] for e in _SRC], np.float32)
PROMPT = "def parse_args(argv):\n    "
PROMPT_IDS = [317, 659, 262, 64, 512, 9, 2044, 304, 200, 259]

ROUTE = {"vllm": "/v1/completions", "sglang": "/generate", "llamacpp": "/completion"}
VARIANTS = {  # name: (engine, stream, the transcript that replaces the engine's default for that mode)
    "vllm-stream": ("vllm", True, None),
    "vllm-nonstream": ("vllm", False, None),
    "vllm-nonstream-cached": ("vllm", False, "vllm__v1-completions__nonstream-cached.http"),
    "sglang-stream": ("sglang", True, None),
    "sglang-stream-incremental": ("sglang", True, "sglang__generate__stream-incremental.http"),
    "sglang-nonstream": ("sglang", False, None),
    "tgi-stream": ("tgi", True, None),
    "tgi-nonstream": ("tgi", False, None),
    "llamacpp-stream": ("llamacpp", True, None),
    "llamacpp-nonstream": ("llamacpp", False, None),
}


def routes_with(engine: str, stream: bool, name: str | None) -> dict:
    routes = routes_for(engine)
    if name is not None:
        key = ("POST", ROUTE[engine])
        routes[key] = {**routes[key], "stream" if stream else "nonstream": load(name)}
    return routes


def capture_one(out: Path, routes: dict, prompt, stream: bool, top_logprobs: int = 5) -> dict:
    """One request through the real capture client (dialect auto): its summary, row, columns and
    the POST bodies the server saw."""
    prompts = write_prompts(out.with_suffix(".jsonl"), [{"id": "a", "prompt": prompt}])
    with ReplayServer(routes) as srv:
        cfg = CaptureConfig(
            srv.url, prompts, str(out), stream=stream, max_tokens=12, top_logprobs=top_logprobs, progress=False
        )
        s = run_capture(cfg)
        sent = list(srv.requests)
    with TraceReader(out) as r:
        pids = r.prompt_ids(0)
        return {
            "s": s,
            "rec": r.record(0),
            "tok": r.tokens(0),
            "run": r.meta.run,
            "sent": sent,
            "pids": None if pids is None else pids.tolist(),
        }


def capture_cache(base: Path):
    """cache(variant) -> the capture of VARIANTS[variant], made once per cache (a test module's
    `captured` fixture holds one)."""
    cache: dict = {}

    def get_(variant: str) -> dict:
        if variant not in cache:
            engine, stream, name = VARIANTS[variant]
            prompt = PROMPT_IDS if engine == "llamacpp" else PROMPT
            cache[variant] = capture_one(base / f"{variant}.h5", routes_with(engine, stream, name), prompt, stream)
        return cache[variant]

    return get_


def one_capture(tmp: Path):
    """one(routes, prompt, stream, **options): a capture that is not shared."""
    return lambda routes, prompt, stream, **kw: capture_one(tmp / "one.h5", routes, prompt, stream, **kw)


def parse_with(dialect: str, objs: list, k: int = 5):
    """The dialect's own parse of these JSON objects (stream events or one body) -> (acc, columns)."""
    d, acc = get(dialect), Acc()
    for obj in objs:
        d.parse_event(obj, acc, 1.0)
    return acc, acc.columns(k, False, None)


def events_of(name: str) -> list:
    return [json.loads(ev.data) for ev in SSEDecoder().feed(load(name).body) if ev.data != "[DONE]"]


def body_of(name: str):
    return json.loads(load(name).body)
