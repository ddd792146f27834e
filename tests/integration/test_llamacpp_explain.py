"""`tracekit explain`'s variants on a real llama-server (issue 24, item 9). Cold runs send
`cache_prompt: false` (reuse 0); warm and burst runs send `cache_prompt: true`. Without
`--slot-save-path` the slots cannot be erased, so a warm run reuses whatever the slots hold: the
run records the boundary it had, the trace says no flush happened, and the analysis never says
"at the same boundary" for runs that did not reuse it. With `--slot-save-path` every slot is
erased before each warm and burst run and warm:32 reuses exactly 32; a burst still cannot put
every member at its boundary (one cache per slot), and its runs say where they landed."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support import load_file

from tracekit.analyze.explain import verdict
from tracekit.analyze.explain_runs import VariantCount
from tracekit.capture.explain.plan import Mate, Target
from tracekit.capture.explain.variants import VariantConfig, run_variants
from tracekit.store import TraceReader

llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
PROMPTS = llamacpp.ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"


def _prompts() -> list[tuple[int, ...]]:
    return [tuple(json.loads(line)["prompt"]) for line in PROMPTS.read_text().splitlines()]


def _target() -> Target:
    p = _prompts()  # 8 prompts sharing a 32-token prefix
    return Target("c0", p[0], 3, 1, 2, 0, 32, (5, 6, 7, 1), (Mate("c1", p[1], 32, 6),), True, (1, 0))


def _rows(path) -> dict:
    by: dict = {}
    with TraceReader(path) as r:
        t = r.requests
        for i in range(len(t)):
            params = json.loads(t.params[i])
            tag = params["explain"]
            by.setdefault((tag["variant"], tag["role"]), []).append(
                (int(t.cached_tokens[i]), params.get("cache_prompt"))
            )
        return by, r.meta.run["explain"]["cache_flush"]


@pytest.fixture(scope="module")
def erasable(llama_bin, gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-slots")
    flags = (*llamacpp.EVIDENCE_FLAGS, "--slot-save-path", str(d))
    with llamacpp.start_server(llama_bin, gguf, slots=4, extra=flags, log_path=str(d / "log")) as eng:
        yield eng


def test_without_slot_erase_each_run_says_what_it_reused(llama, tmp_path):
    s = run_variants(VariantConfig(llama.url, str(tmp_path / "v.h5"), repeats=2, top_logprobs=5), [_target()])
    by, flush = _rows(tmp_path / "v.h5")
    assert s.counts["ok"] == s.rows and flush["available"] and not flush["flushes"], flush
    assert "no slot erase" in flush["reason"] and "--slot-save-path" in flush["reason"], flush["reason"]
    assert by[("alone:cold", "target")] == [(0, False), (0, False)]  # cold: cache_prompt false, reused 0
    assert all(cp is True for _, cp in by[("warm:32", "target")] + by[("burst", "target")])


def test_with_slot_erase_warm_runs_reuse_the_boundary_asked(erasable, tmp_path):
    s = run_variants(VariantConfig(erasable.url, str(tmp_path / "v.h5"), repeats=2, top_logprobs=5), [_target()])
    by, flush = _rows(tmp_path / "v.h5")
    assert s.counts["ok"] == s.rows and flush["flushes"] and flush["slots"] == 4, flush
    assert by[("alone:cold", "target")] == [(0, False), (0, False)]
    assert by[("warm:32", "target")] == [(32, True), (32, True)]  # primed on an erased server: exactly 32
    # A burst cannot be placed: one prime fills one slot, and of the target and its mate sent at
    # once only one lands on it (llama.cpp's cache is per slot). Each run records what it reused.
    burst = [c for c, _ in by[("burst", "target")]] + [c for c, _ in by[("burst", "mate")]]
    # (the mate can reuse 33: its token 32 may equal the one the prime put there)
    assert len(burst) == 4 and all(c >= 0 for c in burst) and max(burst) >= 32, burst


def _count(variant: str, n: int, a: int, b: int, boundaries: dict) -> VariantCount:
    return VariantCount("engine", variant, n=n, a=a, b=b, b_numeric=b, boundaries=Counter(boundaries))


def test_the_cause_states_only_the_boundaries_that_ran():
    """The measured case: bursts landed at 34 and 123, the warm:123 runs reused 34 (no erase).
    The cause says so; prefix reuse is never concluded from runs that did not reuse what was asked."""
    pair = {"boundary_a": 0, "boundary_b": 123, "token_a": 1, "token_b": 2, "position": 3}
    counts = {
        ("engine", "alone:cold"): _count("alone:cold", 5, 5, 0, {0: 5}),
        ("engine", "warm:123"): _count("warm:123", 5, 5, 0, {34: 5}),
        ("engine", "burst"): _count("burst", 5, 0, 5, {34: 3, 123: 2}),
    }
    kind, cause = verdict(pair, counts, {}, "bf16", 3)
    assert kind == "batch_composition", cause
    assert "at the same boundary" not in cause
    assert "0/5 alone (asked at boundary 123; the runs reused 34 (5x)); the bursts reused 34 (3x), 123 (2x)" in cause
    # warm:123 gave B's token but ran at 34: no prefix_reuse claim (before: "alone at B's boundary 123")
    counts[("engine", "warm:123")] = _count("warm:123", 5, 0, 5, {34: 5})
    kind, cause = verdict(pair, counts, {}, "bf16", 3)
    assert kind != "prefix_reuse" and "B's boundary 123" not in cause, (kind, cause)
    counts[("engine", "warm:123")] = _count("warm:123", 5, 0, 5, {123: 5})  # achieved: concluded
    assert verdict(pair, counts, {}, "bf16", 3)[0] == "prefix_reuse"
