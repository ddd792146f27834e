"""Every dialect against replayed transcripts on a real socket: the recorded
llama.cpp / llama-cpp-python responses and the constructed vLLM / SGLang / TGI
ones all carry the same 12 greedy tokens, so each must yield the same columns."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.capture_helpers import TOKENIZER
from support.replay import ReplayServer, load, routes_for

from tracekit.store import TraceReader

# The 12 tokens every transcript holds (llama-server's /completion recording).
_SRC = json.loads(load("llamacpp-server__completion__nonstream.http").body)["completion_probabilities"]
IDS = [e["id"] for e in _SRC]
TOP1 = [e["top_logprobs"][1]["id"] for e in _SRC]
PROMPT = "def parse_args(argv):\n    "
PROMPT_IDS = [317, 659, 262, 64, 512, 9, 2044, 304, 200, 259]

CASES = [  # engine, dialect (auto must find it unless None), prompt, expected cached_tokens (stream, nonstream)
    ("llamacpp", "llamacpp", PROMPT_IDS, (9, 0)),
    ("llamacpp", "openai", PROMPT, (9, 9)),
    ("llamacpp", "openai-chat", PROMPT, (33, None)),
    ("llama-cpp-python", "openai", PROMPT, (-1, -1)),
    ("vllm", "vllm", PROMPT, (8, -1)),
    ("sglang", "sglang", PROMPT, (9, 9)),
    ("tgi", "tgi", PROMPT, (-1, -1)),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
@pytest.mark.parametrize("engine,dialect,prompt,cached", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_dialect_columns(capture_to, engine, dialect, prompt, cached, stream):
    auto = dialect in ("llamacpp", "vllm", "sglang", "tgi") or engine == "llama-cpp-python"
    with ReplayServer(routes_for(engine), seed=hash((engine, dialect)) % 1000) as srv:
        s, out = capture_to(
            srv.url,
            [{"id": "a", "prompt": prompt}, {"id": "b", "prompt": prompt}],
            dialect="auto" if auto else dialect,
            stream=stream,
            tokenizer=TOKENIZER,
            concurrency=2,
        )
    assert s.counts["ok"] == 2 and s.failed == 0 and s.dialect == dialect
    with TraceReader(out) as r:
        assert r.meta.run["dialect"] == dialect and r.meta.run["dialect_reason"]
        if engine == "llamacpp" and dialect == "llamacpp":  # the version from /props is recorded
            assert r.meta.run["engine"]["props"]["build_info"] == "b1-0c1e570"
            assert r.meta.run["engine"]["health_status"] == 200
        assert sorted(r.requests.key) == ["a", "b"]
        for i in range(2):
            rec, tok = r.record(i), r.tokens(i)
            if dialect == "openai-chat":
                assert len(tok) == 12 and tok.token_id[0] in (200,)  # chat template: other tokens
                assert np.all(tok.topk_id[:, :5] >= 0)
            else:
                assert tok.token_id.tolist() == IDS
                assert tok.topk_id[:, 1].tolist() == TOP1
                np.testing.assert_allclose(
                    tok.logprob, [e["logprob"] for e in _SRC], atol=2e-5
                )  # engines agree to ~1e-5
            assert np.all(np.diff(tok.t_arrival_s) >= 0)
            assert rec.t_sent_s <= rec.t_first_token_s <= rec.t_done_s
            assert rec.finish_reason == "length"
            want = cached[0 if stream else 1]
            if want is not None:
                assert rec.cached_tokens == want
            if dialect == "openai-chat":  # the engine's chat template makes other ids: unknown
                assert rec.prompt_len == -1 and rec.prompt_text == PROMPT
            else:  # sent as ids, echoed (vllm), else --tokenizer (the replay has no /tokenize)
                assert r.prompt_ids(i).tolist() == PROMPT_IDS


def test_llamacpp_without_probabilities_still_records_ids():
    """n_probs 0: llama.cpp stream events carry only `tokens: [id]`; ids are kept, logprobs NaN."""
    from tracekit.capture.dialects import Acc, get
    from tracekit.capture.sse import SSEDecoder

    d, acc = get("llamacpp"), Acc()
    for ev in SSEDecoder().feed(load("llamacpp-server__completion__stream.http").body):
        obj = json.loads(ev.data)
        obj.pop("completion_probabilities", None)
        d.parse_event(obj, acc, 1.0)
    cols = acc.columns(0, False, None)
    assert cols.token_id.tolist() == IDS and np.isnan(cols.logprob).all() and acc.done
    assert acc.cached_tokens == 9 and acc.finish_reason == "length"
