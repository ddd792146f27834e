"""`tracekit capture --replay-http` against a real llama-server (f32 GGUF of the fixture model):
llama.cpp has no prompt logprobs, so the replay asks one token at a time (the prompt and the
traced tokens before it, n_predict 1, n_probs k). Cold is proven cold (cache_prompt false:
timings.cache_n 0 at every step), warm proven warm at the recorded boundary (slot 0 primed with
the prompt's first 16 tokens before each step: cache_n 16 at every step), and the replayed logprob
of every traced token equals the live generation's within the FP32 tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tracekit.analyze import diff
from tracekit.capture.replay_http import ReplayHttpConfig, parse_histories, run_replay_http
from tracekit.store import TraceReader

PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "cpu_small.jsonl"


def _cols(path):
    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(r)):
            c = r.tokens(i)
            key = (t.key[i], t.history[i]) if t.history[i] else t.key[i]
            out[key] = (int(t.cached_tokens[i]), t.status[i], json.loads(t.params[i] or "{}"), c.token_id, c.logprob,
                        c.topk_id)  # fmt: skip
    return out


def test_step_by_step_replay_cold_and_warm_match_the_live_run(llama, capture, tmp_path):
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:3]]
    s, live_path = capture(llama.url, "live", prompts=prompts, max_tokens=8, concurrency=1)
    assert s.counts["ok"] == 3
    live = _cols(live_path)
    out = tmp_path / "replay.h5"
    rs = run_replay_http(ReplayHttpConfig(llama.url, str(live_path), str(out), parse_histories("cold,warm:16"),
                                          top_logprobs=5))  # fmt: skip
    assert (rs.engine, rs.method) == ("llamacpp", "step-by-step")
    assert rs.rows == rs.ok == 6 and not rs.failed
    rep = _cols(out)
    assert sorted(rep) == sorted((k, h) for k in live for h in ("engine:cold", "engine:warm:16"))
    worst = 0.0
    for (key, hist), (cached, status, params, ids, lp, tid) in rep.items():
        want = 0 if hist == "engine:cold" else 16
        assert status == "ok" and cached == want
        assert params["cache_n_per_step"] == [want] * 8 and params["not_in_topk"] == 0
        np.testing.assert_array_equal(ids, live[key][3])
        np.testing.assert_array_equal(tid[:, 0], live[key][3])  # greedy: the traced token is the engine's top-1
        worst = max(worst, float(np.abs(lp - live[key][4]).max()))
    assert worst < 1e-4, worst
    doc = diff(live_path, out, b_select="history=engine:warm:16").to_json()
    assert doc["summary"]["identical"] == doc["summary"]["pairs"] == 3
