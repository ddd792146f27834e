"""The official `openai` client can use the engine: completions, streaming, logprobs."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")  # a dev dependency; the GPU image lacks it


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def test_completion_with_logprobs(client):
    r = client.completions.create(
        model="tiny",
        prompt="import os\nimport sys\n",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ch = r.choices[0]
    assert r.usage.completion_tokens == 6 and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == 6 and len(ch.logprobs.token_logprobs) == 6
    assert all(len(t) == 3 for t in ch.logprobs.top_logprobs)
    # greedy: the chosen token is the top-1 candidate
    assert all(max(top.values()) == lp for top, lp in zip(ch.logprobs.top_logprobs, ch.logprobs.token_logprobs))
    assert len(ch.model_extra["token_ids"]) == 6


def test_streaming_matches_non_streaming(client):
    kw = dict(
        model="tiny",
        prompt="class Node:\n    def __init__(self",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, logprobs=1, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == 12


def test_models_lists_engine_meta(client):
    m = client.models.list().data[0]
    assert m.id == "tiny"
    assert m.model_extra["meta"]["eos_token_ids"] == [0]
