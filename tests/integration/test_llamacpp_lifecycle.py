"""cancel_then_match on a real llama-server (issue 24, item 2): after a cancel, llama.cpp's slot
holds another prompt, so the probe reuses another prefix than before the disconnects; the check
tests what it claims (the same output after cancel + drain) and reports the moved boundary as
information. Before the fix a moved boundary failed the check (12 of 13 healthy cells)."""

from __future__ import annotations

import pytest
from support import load_file

from tracekit.capture.http import CaptureConfig, plan_requests
from tracekit.capture.matrix.lifecycle import lifecycle_checks
from tracekit.capture.prompts import load_prompts

llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
PROMPTS = llamacpp.ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"  # 32-token shared prefix


@pytest.fixture(scope="module")
def one_slot(llama_bin, gguf, tmp_path_factory):
    """A fresh 1-slot server: the probe's first request finds the slot empty (reuses 0)."""
    log = tmp_path_factory.mktemp("llama-1slot") / "llama-server.log"
    with llamacpp.start_server(llama_bin, gguf, slots=1, log_path=str(log)) as eng:
        yield eng


def test_cancel_then_match_passes_when_only_the_boundary_moved(one_slot):
    cfg = CaptureConfig(url="", prompts="", out="", max_tokens=16, top_logprobs=5, ignore_eos=True)
    specs = plan_requests(load_prompts(str(PROMPTS)), cfg)
    drain, match, bad = lifecycle_checks(
        one_slot.url, specs, probe_i=0, k_cancel=2, after_tokens=4, drain_timeout_s=30, timeout_s=60
    )
    assert drain.status == "pass", drain.summary
    ev = match.evidence
    # The boundary moved (0 on the empty slot; after the cancels the slot holds p0 or p1, which
    # share a 32-token prefix with the probe) ...
    assert ev["reused_prefix_before"] == 0 and ev["reused_prefix_after"] >= 32, ev
    assert ev["reused_prefix_changed"] is True
    # ... and the output did not: same 16 ids, logprobs within f32 noise.
    assert ev["tokens_match_before"] is True and ev["first_difference_vs_before"] is None
    assert ev["after"]["token_ids"] == ev["before"]["token_ids"] and len(ev["after"]["token_ids"]) == 16
    assert ev["max_abs_dlogprob_vs_before"] < 1e-4
    assert match.status == "pass", match.summary
    assert "tokens match the probe before the disconnects (16 ids)" in match.summary
    assert f"reused prefix 0 -> {ev['reused_prefix_after']} tokens (information" in match.summary
    assert bad.status == "pass", bad.summary
