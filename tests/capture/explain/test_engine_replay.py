"""`tracekit explain --engine-replay`: each pair's tokens replayed through the engine itself, cold
and at A's and B's boundaries (capture/replay_http.py), and the verdict that reads those rows.

The capture side against a real reference engine (each history proven by the engine's report, the
rows readable as explain's teacher dict), the verdict on constructed evidence: B's token at B's
boundary and A's at A's is a cache-history cause, from the engine's own logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.analyze.explain import verdict
from tracekit.analyze.explain_runs import read_teacher
from tracekit.capture.explain import Target
from tracekit.capture.explain.replay import engine_histories, engine_replay
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "fp32.log"
    with start_engine(["--threads", "1"], log_path=str(log)) as eng:
        yield eng


def test_engine_replay_rows_are_proven_and_read_as_explain_evidence(engine, tmp_path):
    """A target whose A side reused 0 and B side 32 tokens, replayed on the engine: rows
    engine:cold (cached 0) and engine:warm:32 (cached 32), both ok; the engine's top-1 at t is
    A's token there (the live greedy run's own token at t), read as `engine:... fp32` evidence."""
    p = PROMPTS.read_text().splitlines()[1]
    prompt = json.loads(p)["prompt"]
    (tmp_path / "one.jsonl").write_text(p + "\n")
    cfg = CaptureConfig(url=engine.url, prompts=str(tmp_path / "one.jsonl"), out=str(tmp_path / "live.h5"),
                        max_tokens=6, top_logprobs=5, ignore_eos=True, progress=False)  # fmt: skip
    run_capture(cfg)
    with TraceReader(tmp_path / "live.h5") as r:
        live = r.tokens(0).token_id.tolist()
    t = 4
    tg = Target("c1", tuple(prompt), t, live[t], (live[t] + 1) % 2048, 0, 32, tuple(live[: t + 1]), (), True)
    assert [h.asked for h in engine_histories(tg)] == ["cold", "warm:32"]
    out = tmp_path / "engine-replay.h5"
    s = engine_replay(engine.url, str(out), [tg], {"dtype": "fp32"}, top_logprobs=5)
    assert (s.ok, s.rows, s.engine, s.method) == (2, 2, "tracekit", "forced")
    with TraceReader(out) as r:
        got = {r.requests.history[i]: int(r.requests.cached_tokens[i]) for i in range(len(r))}
    assert got == {"engine:cold": 0, "engine:warm:32": 32}
    pair = {"c1": {"key": "c1", "position": t, "token_a": tg.token_a, "token_b": tg.token_b}}
    assert read_teacher(str(out), pair) == {"c1": {"engine:cold fp32": live[t], "engine:warm:32 fp32": live[t]}}


def test_the_engines_own_replay_names_a_cache_history_cause():
    """No live variant ran; the engine's replay gives B's token at B's boundary 32 and A's cold
    (A's boundary 0): cause cache history, said with both boundaries. With the two swapped it is
    not (the rule needs B's token at B's boundary), and the HF cache rule ignores engine rows."""
    p = {"boundary_a": 0, "boundary_b": 32, "token_a": 7, "token_b": 9, "class": "bf16_tie_flip"}
    kind, cause = verdict(p, {}, {"engine:cold bf16": 7, "engine:warm:32 bf16": 9}, "bf16", 0)
    assert kind == "cache_history"
    assert cause.startswith("cause: cache history — the engine's own teacher-forced replay gives B's token at B's")
    assert "32" in cause and "no live variant reproduced it (none ran)" in cause
    kind, _ = verdict(p, {}, {"engine:cold bf16": 9, "engine:warm:32 bf16": 7}, "bf16", 0)
    assert kind != "cache_history"
