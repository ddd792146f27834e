"""--ignore-eos across engines, live: the fixture model in tracekit serve and in llama-server.

Why it matters: both engines "ignore EOS", yet where the model ranks an EOS first tracekit serve
emits it and goes on while llama.cpp's sampler forbids it (-inf bias) and emits the runner-up; its
logprobs, taken before the sampler, still rank the EOS first. `tracekit diff` must call that pair
a checked `post_eos` (llama.cpp's own top-1 is the EOS A emitted, its token the best non-EOS one)
and say in one note how the engines differ, instead of leaving an unexplained pair to be hunted
as a bug. traces/ignore-eos/ holds the
same captures for the always-run test (tests/analyze/test_ignore_eos_note.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tracekit.analyze.compare import diff
from tracekit.engine.process import start_engine
from tracekit.store import TraceReader

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny"
# p11 of fixtures/prompts/tiny.jsonl: the model ranks EOS (0) first at position 52.
P11 = [{"id": "p11", "prompt": "def main():\n    "}]


@pytest.fixture(scope="module")
def serve():
    with start_engine(["--slots", "2", "--threads", "1"]) as eng:
        yield eng


@pytest.mark.parametrize("ignore", [True, False])
def test_ignore_eos_differs_between_engines_and_diff_says_so(llama, serve, capture, ignore):
    _, a = capture(serve.url, f"serve-{ignore}", P11, max_tokens=64, ignore_eos=ignore)
    _, b = capture(llama.url, f"llama-{ignore}", P11, max_tokens=64, ignore_eos=ignore, tokenizer=str(TOKENIZER))
    with TraceReader(b) as t:
        tok = t.tokens(0)
        assert tok.topk_id[52, 0] == 0  # the EOS ranks first in llama.cpp's own top-k
        assert tok.token_id[52] == (200 if ignore else 0)  # ... and is emitted only without ignore_eos
    r = diff(a, b)
    p = r.by_key("p11")
    notes = [n for n in r.notes if "ignore_eos" in n]
    if ignore:
        assert (p.cls, p.position, p.token_a, p.token_b) == ("post_eos", 52, 0, 200)
        assert "llama.cpp, ignore_eos" in p.rule and "best non-EOS" in p.rule, p.rule
        assert r.ok  # exit 0
        assert len(notes) == 1 and notes[0].startswith("A is tracekit serve, B is llama.cpp, both ran")
    else:
        assert p.cls == "identical" and (p.len_a, p.len_b) == (53, 53) and notes == []
