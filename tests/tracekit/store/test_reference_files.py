"""Every format version's reference file stays readable forever (anndata's habit)."""

from pathlib import Path

import numpy as np
import pytest
from support import load_file

from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
reference_requests = load_file("fixtures/format/make_reference.py", "make_reference").reference_requests

REFS = sorted((ROOT / "fixtures" / "format").glob("v*/reference.h5"))
CAPTURES = sorted((ROOT / "fixtures" / "format").glob("v*/capture.h5"))


def test_there_is_a_v1_reference():
    assert ROOT / "fixtures/format/v1/reference.h5" in REFS


@pytest.mark.parametrize("path", REFS, ids=[p.parent.name for p in REFS])
def test_reference_file_reads(path):
    with TraceReader(path) as r:
        assert r.meta.run["eos_token_ids"] == [0]
        assert list(r.requests.status) == ["ok", "error", "cancelled"]
        assert r.layout.topk == 5 and r.layout.raw_logits and r.layout.vocab_size == 16
        for i, (rec, toks, prompt) in enumerate(reference_requests()):
            got = r.record(i)
            assert (got.key, got.cached_tokens, got.http_status, got.error) == (
                rec.key,
                rec.cached_tokens,
                rec.http_status,
                rec.error,
            )
            t = r.tokens(i, full_logits=True)
            np.testing.assert_array_equal(t.topk_id, toks.topk_id)
            np.testing.assert_allclose(t.topk_logprob, toks.topk_logprob)
            np.testing.assert_allclose(t.logits, toks.logits)
            np.testing.assert_array_equal(r.prompt_ids(i), prompt)


@pytest.mark.parametrize("path", CAPTURES, ids=[p.parent.name for p in CAPTURES])
def test_real_capture_reads(path):
    """A real capture of each version (fixtures/format/make_capture.py) stays readable too."""
    with TraceReader(path) as r:
        assert r.meta.source == "http" and r.meta.run["dialect"] == "vllm" and r.layout.topk == 5
        assert len(r) == 8 and set(r.requests.status) == {"ok"} and r.n_token_rows == 256
        for i in range(len(r)):
            assert len(r.prompt_ids(i)) == r.record(i).prompt_len > 0 and len(r.tokens(i)) == 32
