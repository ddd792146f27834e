"""Sampling penalties on a real llama-server (issue 24, item 7). llama-server takes its default
penalties from its command line; a capture sends neutral values with every request, so a server
started with `--repeat-penalty 1.5` gives the greedy tokens of the raw logits (before: other
tokens, and pairs blamed on the engine). A prompt that asks for llama.cpp's `repeat_penalty`
itself is warned about at capture and kept apart by the diff ("requests differ")."""

from __future__ import annotations

import json

import pytest
from support import load_file

from tracekit.analyze.compare import diff
from tracekit.store import TraceReader

llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
PROMPTS = llamacpp.ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"
NEUTRAL = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0}


@pytest.fixture(scope="module")
def penalised(llama_bin, gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("llama-pen") / "llama-server.log"
    flags = (*llamacpp.EVIDENCE_FLAGS, "--repeat-penalty", "1.5", "--repeat-last-n", "64")
    with llamacpp.start_server(llama_bin, gguf, slots=2, extra=flags, log_path=str(log)) as eng:
        yield eng


def test_neutral_penalties_sent_whatever_the_servers_defaults(llama, penalised, capture):
    _, plain = capture(llama.url, "plain", max_tokens=48)
    s, pen = capture(penalised.url, "penalised-server", max_tokens=48)
    assert s.failed == 0, s.failures
    with TraceReader(pen) as r:
        run = r.meta.run
        bodies = [json.loads(r.record(i).params) for i in range(len(r))]
    counts = diff(plain, pen).counts()
    assert counts["pairs"] == 8 and counts["identical"] == 8, counts
    assert run["engine"]["props"]["default_penalties"]["repeat_penalty"] == pytest.approx(1.5)
    assert run["engine"]["neutral_penalties"] == NEUTRAL
    assert all({k: b[k] for k in NEUTRAL} == NEUTRAL for b in bodies), bodies[0]


def test_a_prompts_repeat_penalty_is_warned_and_kept_apart(llama, capture, capsys):
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    _, plain = capture(llama.url, "plain2", prompts, max_tokens=48)
    capsys.readouterr()
    s, hot = capture(llama.url, "hot", [{**p, "extra": {"repeat_penalty": 1.3}} for p in prompts], max_tokens=48)
    err = capsys.readouterr().err
    assert "not_greedy" in s.pitfalls and "8 of 8 requests are not greedy (repeat_penalty 1.3)" in err, err
    with TraceReader(hot) as r:
        assert all(json.loads(r.record(i).params)["repeat_penalty"] == 1.3 for i in range(len(r)))
    res = diff(plain, hot)
    assert res.counts()["unexplained"] == 0, res.counts()
    changed = [p for p in res.pairs if p.cls != "identical"]
    assert changed, "the penalty changed no stream: the test shows nothing"
    assert all(p.cls == "incomparable" and "repeat_penalty - vs 1.3" in p.rule for p in changed), [
        (p.key, p.cls, p.rule) for p in changed
    ]
