"""The deterministic configuration: `tracekit serve --batch-invariant` gives a request the
same bits whatever its batch mates (serial vs concurrent BF16, N/N bitwise), so the
variants of `tracekit explain` on it agree with each other; and the teacher-forced
replay writes the histories explain reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tracekit.analyze import diff
from tracekit.capture.explain import Mate, ReplayConfig, Target, VariantConfig, replay, run_variants, tag_of
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"
MODEL = ROOT / "fixtures" / "models" / "tiny"


def _prompts() -> list[tuple[int, ...]]:
    return [tuple(json.loads(line)["prompt"]) for line in PROMPTS.read_text().splitlines()]


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "bi.log"
    args = ["--threads", "1", "--slots", "8", "--dtype", "bf16", "--batch-invariant"]
    with start_engine(args, log_path=str(log)) as eng:
        yield eng


def test_serial_and_concurrent_bf16_are_bitwise_identical(invariant, tmp_path):
    """The issue's must-show: with --batch-invariant, BF16 serial vs 8 concurrent is N/N
    identical and every pair's chosen logprobs are bit-for-bit equal (the burst also reuses
    the prefixes the serial run cached, at block boundaries)."""
    for name, conc in (("serial", 1), ("burst", 8)):
        cfg = CaptureConfig(url=invariant.url, prompts=str(PROMPTS), out=str(tmp_path / f"{name}.h5"),
                            concurrency=conc, top_logprobs=5, ignore_eos=True, progress=False)  # fmt: skip
        assert run_capture(cfg).counts["ok"] == 8
    doc = diff(tmp_path / "serial.h5", tmp_path / "burst.h5").to_json()
    assert doc["summary"]["identical"] == doc["summary"]["pairs"] == 8
    assert all(p["bitwise"] for p in doc["pairs"])
    with TraceReader(tmp_path / "burst.h5") as r:
        assert r.meta.run["engine"]["v1_models"]["meta"]["batch_invariant"] is True
        assert (r.requests.cached_tokens > 0).any()  # the burst did reuse prefixes


def test_every_variant_agrees_on_the_deterministic_configuration(invariant, tmp_path):
    """alone cold, warm at 32, and a burst with 7 batch mates: the target's rows are the same
    ids and the same logprob bits in every run."""
    ps = _prompts()
    mates = tuple(Mate(f"c{i}", ps[i], 32, 8) for i in (0, 2, 3, 4, 5, 6, 7))
    tg = Target("c1", ps[1], 7, 1, 2, 0, 32, (1,) * 8, mates, True)
    s = run_variants(VariantConfig(invariant.url, str(tmp_path / "v.h5"), "deterministic", 2, 5), [tg])
    assert s.counts["ok"] == s.rows
    seen = {}
    with TraceReader(tmp_path / "v.h5") as r:
        for i in range(len(r)):
            tag = tag_of(r.requests.params[i])
            if tag["role"] == "target":
                cols = r.tokens(i)
                seen[r.requests.key[i]] = (cols.token_id.tobytes(), cols.logprob.tobytes())
    assert sorted(seen) == sorted(f"c1@{v}#r{k}" for v in ("alone:cold", "warm:32", "burst") for k in (0, 1))
    assert len(set(seen.values())) == 1


def test_teacher_forced_replay_rows(tmp_path):
    """full, decode and prefix at both boundaries (0 has none), over A's tokens up to t."""
    ps = _prompts()
    tg = Target("c1", ps[1], 3, 7, 9, 0, 32, (5, 6, 7, 8), (), True)
    s = replay(ReplayConfig(str(MODEL), str(tmp_path / "t.h5"), ("fp32",), "cpu", 5), [tg])
    assert s.rows == 3
    with TraceReader(tmp_path / "t.h5") as r:
        t = r.requests
        assert sorted(t.history) == ["decode", "full", "prefix:32"] and set(t.key) == {"c1"}
        for i in range(len(t)):
            assert np.array_equal(r.tokens(i).token_id, [5, 6, 7, 8]) and np.array_equal(r.prompt_ids(i), ps[1])


def test_each_pair_is_replayed_under_its_own_boundaries_only(tmp_path):
    """Issue 24 item 12: two pairs with boundaries {32} and {16, 40} -> 3 + 4 rows a dtype (full,
    decode, a prefix at each own boundary), not 5 + 5 (every pair's boundaries for every pair:
    10 rows where 7 suffice, and a pair's verdict could read another pair's boundary)."""
    ps = _prompts()
    one = Target("c1", ps[1], 3, 7, 9, 0, 32, (5, 6, 7, 8), (), True)
    two = Target("c2", ps[2], 3, 7, 9, 16, 40, (5, 6, 7, 8), (), True)
    s = replay(ReplayConfig(str(MODEL), str(tmp_path / "t.h5"), ("fp32",), "cpu", 5), [one, two])
    assert s.rows == 7
    with TraceReader(tmp_path / "t.h5") as r:
        t = r.requests
        got = {k: sorted(h for kk, h in zip(t.key, t.history) if kk == k) for k in ("c1", "c2")}
        assert got == {"c1": ["decode", "full", "prefix:32"], "c2": ["decode", "full", "prefix:16", "prefix:40"]}
        assert r.meta.run["histories"] == ["full", "decode", "prefix:16", "prefix:32", "prefix:40"]
        # the shared histories are the same numbers whether or not the pairs share a batch
        full = {t.key[i]: r.tokens(i).topk_logit for i in range(len(t)) if t.history[i] == "full"}
    s1 = replay(ReplayConfig(str(MODEL), str(tmp_path / "one.h5"), ("fp32",), "cpu", 5), [one])
    with TraceReader(tmp_path / "one.h5") as r:
        alone = {r.requests.key[i]: r.tokens(i).topk_logit for i in range(len(r)) if r.requests.history[i] == "full"}
    assert s1.rows == 3 and np.array_equal(alone["c1"], full["c1"])
