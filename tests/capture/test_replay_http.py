"""`tracekit capture --replay-http`: the engine's own logits of the traced tokens, replayed over
HTTP under a stated cache history, against the reference engine (real servers on 127.0.0.1).

BF16 on the deterministic engine: the replay (forced tokens, the live decode path) at the live
row's own boundary is bitwise the live generation; cold is proven cold (cached_tokens 0) and
warm proven warm at the recorded boundary. FP32 with vLLM-style prompt_logprobs (one prefill
forward): within the FP32 tolerance, and `diff --b-select history=engine:cold` reads the rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tracekit.analyze import diff
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.capture.replay_http import ReplayHttpConfig, parse_histories, run_replay_http
from tracekit.cli import cli as cli_main
from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"  # 8 prompts, 32-token shared prefix


@pytest.fixture(scope="module")
def bf16_invariant(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "bi.log"
    with start_engine(["--threads", "1", "--dtype", "bf16", "--batch-invariant"], log_path=str(log)) as eng:
        yield eng


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "fp32.log"
    with start_engine(["--threads", "1"], log_path=str(log)) as eng:
        yield eng


def _live(url: str, out: Path, n: int = 4) -> Path:
    lines = PROMPTS.read_text().splitlines()[:n]
    p = out.parent / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    cfg = CaptureConfig(url=url, prompts=str(p), out=str(out), concurrency=1, max_tokens=12, top_logprobs=5,
                        ignore_eos=True, progress=False)  # fmt: skip
    assert run_capture(cfg).counts["ok"] == n
    return out


def _rows(path: Path) -> dict:
    """{(key, history): (cached_tokens, status, params, token_id, logprob, topk_id, topk_logit)}"""
    out = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(r)):
            c = r.tokens(i)
            lg = c.topk_logit if c.topk_logit is not None else None
            key = (t.key[i], t.history[i]) if t.history[i] else t.key[i]
            out[key] = (int(t.cached_tokens[i]), t.status[i], json.loads(t.params[i] or "{}"),
                        c.token_id, c.logprob, c.topk_id, lg)  # fmt: skip
    return out


def test_bf16_forced_replay_is_the_live_generation_bitwise(bf16_invariant, tmp_path):
    """Live serial capture (key 0 cold, keys 1-3 warm at 32), then the replay under cold and
    warm:auto: every row proven (cold: cached 0; warm: the engine reported the live boundary, 32),
    and every row's traced-token logprobs, top-5 ids and top-5 logits bitwise the live run's
    (the deterministic engine is invariant to the boundary too, so cold equals live as well)."""
    live = _rows(_live(bf16_invariant.url, tmp_path / "live.h5"))
    out = tmp_path / "replay.h5"
    s = run_replay_http(ReplayHttpConfig(bf16_invariant.url, str(tmp_path / "live.h5"), str(out),
                                         parse_histories("cold,warm:auto"), top_logprobs=5))  # fmt: skip
    assert (s.engine, s.method) == ("tracekit", "forced")
    assert s.rows == 7 and s.ok == 7 and not s.failed  # key c0 reused nothing live: no warm:auto row
    assert s.skipped == ["c0 warm:auto (the live row reused nothing (cached_tokens 0): that history is `cold`)"]
    rep = _rows(out)
    assert sorted(rep) == sorted(
        [(k, "engine:cold") for k in live] + [(k, "engine:warm:32") for k in live if k != "c0"]
    )
    for (key, hist), (cached, status, params, ids, lp, tid, tlg) in rep.items():
        l_cached, _, _, l_ids, l_lp, l_tid, l_tlg = live[key]
        assert status == "ok"
        assert cached == (0 if hist == "engine:cold" else l_cached) and (hist == "engine:cold" or l_cached == 32)
        assert params["cached_tokens_reported"] == cached and params["boundary_asked"] == (0 if "cold" in hist else 32)
        np.testing.assert_array_equal(ids, l_ids)
        assert lp.tobytes() == l_lp.tobytes(), (key, hist)
        assert tid.tobytes() == l_tid.tobytes() and tlg.tobytes() == l_tlg.tobytes(), (key, hist)
    with TraceReader(out) as r:
        assert r.meta.source == "teacher_forced" and set(r.requests.dtype) == {"bf16"}
        assert r.meta.run["replay_http"]["method"] == "forced"


def test_fp32_prompt_logprobs_replay_is_within_tolerance_and_diffable(fp32, tmp_path):
    """FP32, prompt_logprobs (one prefill forward over prompt + traced tokens): the traced
    tokens' logprobs within 1e-4 nats of the live ones, and `diff` of the live trace against the
    cold rows (--b-select history=engine:cold) calls every pair identical."""
    live_path = _live(fp32.url, tmp_path / "live.h5")
    live = _rows(live_path)
    out = tmp_path / "replay.h5"
    cfg = ReplayHttpConfig(fp32.url, str(live_path), str(out), parse_histories("cold,warm:16"), top_logprobs=5,
                           method="prompt-logprobs")  # fmt: skip
    s = run_replay_http(cfg)
    assert s.method == "prompt-logprobs" and s.ok == s.rows == 8
    rep = _rows(out)
    for (key, hist), (cached, status, _, ids, lp, _, _) in rep.items():
        assert cached == (0 if hist == "engine:cold" else 16) and hist in ("engine:cold", "engine:warm:16")
        np.testing.assert_array_equal(ids, live[key][3])
        assert np.abs(lp - live[key][4]).max() < 1e-4
    doc = diff(live_path, out, b_select="history=engine:cold").to_json()
    assert doc["summary"]["identical"] == doc["summary"]["pairs"] == 4


def test_vllm_dialect_refuses_warm_and_never_claims_an_unproven_cold(fp32, tmp_path):
    """Replayed as vLLM would be (prompt_logprobs, against the reference engine's vLLM shape):
    warm is refused with vLLM's own reason, one line. vLLM never reads its cache for these
    requests; the reference engine does, so with the live prompts still cached it reports 32
    reused tokens and each cold row is an error saying so, not a cold row. After a cache reset
    the cold rows are written, proven by the reported 0."""
    live_path = _live(fp32.url, tmp_path / "live.h5", n=1)
    out = tmp_path / "replay.h5"
    cfg = ReplayHttpConfig(fp32.url, str(live_path), str(out), parse_histories("cold,warm:auto"), top_logprobs=5,
                           engine="vllm")  # fmt: skip
    s = run_replay_http(cfg)
    assert s.ok == 0 and s.failed == ["c0 cold: asked cold, the engine reused 32 tokens"]
    import asyncio

    import aiohttp

    async def reset():
        async with aiohttp.ClientSession() as sess, sess.post(f"{fp32.url}/reset_prefix_cache", json={}) as r:
            assert r.status == 200

    asyncio.run(reset())
    s = run_replay_http(cfg)
    assert s.ok == s.rows == 1 and len(s.refused) == 1
    assert s.refused[0].startswith("warm:auto: vLLM never reads the prefix cache for a request with prompt_logprobs")
    with TraceReader(out) as r:
        assert set(r.requests.history) == {"engine:cold"}
        assert "warm:auto" in r.meta.run["replay_http"]["refused"]


def test_cli_replay_and_its_usage_errors(fp32, tmp_path):
    live_path = _live(fp32.url, tmp_path / "live.h5", n=1)
    runner = CliRunner()
    out = tmp_path / "cli.h5"
    base = ["capture", "--replay-http", fp32.url, "--from", str(live_path), "--top-logprobs", "5"]
    r = runner.invoke(cli_main, [*base, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    with TraceReader(live_path) as tr:
        warm = int(tr.requests.cached_tokens[0]) > 0  # the engine is shared: an earlier test may have cached c0
    assert doc["rows"] == doc["ok"] == 1 + warm  # cold, and warm:auto where the live row reused a prefix
    bad = runner.invoke(cli_main, [*base, "--out", str(tmp_path / "x.h5"), "--history", "prefix:8"])
    assert bad.exit_code == 2 and "bad --history item 'prefix:8'" in bad.output
    wrong = runner.invoke(cli_main, [*base, "--out", str(tmp_path / "y.h5"), "--concurrency", "2"])
    assert wrong.exit_code == 2 and "--concurrency: only with --http" in wrong.output
