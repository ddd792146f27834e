"""The client parses streams with the json module when orjson is missing (the GPU image has none):
the same columns as with orjson, and a malformed event is still the row's error, naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _vllm_event(**choice) -> dict:
    """vLLM 0.33's streamed token event (completions route, return_tokens_as_token_ids and
    return_token_ids on), with its explicit nulls."""
    ch = {
        "index": 0,
        "text": " w7",
        "logprobs": {
            "text_offset": [4],
            "token_logprobs": [-0.25],
            "tokens": ["token_id:7"],
            "top_logprobs": [{"token_id:7": -0.25, "token_id:3": -1.5, "token_id:11": -2.0}],
        },
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": [7],
        "weight_versions": None,
    }
    ch.update(choice)
    return {"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [ch], "usage": None}


JSON_FALLBACK = r"""
import json, sys
sys.modules["orjson"] = None  # as on an image without orjson
from tracekit.capture import client
from support.sse_replay import capture_stream

assert client._loads is json.loads, client._loads
events = json.loads(sys.argv[1])
outcome, acc = capture_stream([b"data: " + e.encode() + b"\n\n" for e in events], 3)
cols = acc.columns(3, False, None) if outcome.record.status == "ok" else None
print(json.dumps({"status": outcome.record.status, "error": outcome.record.error,
                  "topk": cols.topk_id.tolist() if cols is not None else None}))
"""


@pytest.mark.parametrize("broken", [False, True])
def test_the_client_falls_back_to_json_without_orjson(broken):
    """Without orjson the stream is parsed by json.loads: the same columns; a malformed event is
    still the row's error, naming the event."""
    evs = [json.dumps(_vllm_event()), json.dumps(_vllm_event(finish_reason="length"))]
    if broken:
        evs.insert(1, '{"choices": [')
    evs.append("[DONE]")
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]  # tests/: support.sse_replay
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(
        [sys.executable, "-c", JSON_FALLBACK, json.dumps(evs)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if broken:
        assert got["status"] == "error" and got["error"].startswith("malformed JSON in stream event 2:"), got
    else:
        assert got == {"status": "ok", "error": "", "topk": [[7, 3, 11], [7, 3, 11]]}
