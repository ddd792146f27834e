"""`tracekit diff` says, in one note, when A and B come from engines that implement ignore_eos
differently. Why it matters: two engines that both "ignore EOS" still part at the first position
where the model ranks an EOS first. Where llama.cpp's side skipped the EOS the pair is post_eos
(each part checked); without the note a user would not know why the engines part there, nor how
to compare them beyond it.

Real traces (traces/ignore-eos/README.md): the fixture model served by `tracekit serve` and by
llama.cpp's llama-server (f32 GGUF), 3 prompts, 64 tokens, top-5, with and without --ignore-eos.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tracekit.analyze.compare import diff
from tracekit.analyze.diff_report import json_doc, text
from tracekit.analyze.eos_policy import family, ignore_eos_note
from tracekit.store import TraceReader

HERE = Path(__file__).resolve().parents[2] / "traces" / "ignore-eos"
SERVE, LLAMA = HERE / "serve.ignore-eos.h5", HERE / "llamacpp.ignore-eos.h5"


def _note(r) -> str:
    found = [n for n in r.notes if "ignore_eos" in n]
    assert len(found) <= 1, found
    return found[0] if found else ""


def test_tracekit_serve_against_llamacpp_with_ignore_eos():
    """p11: at position 52 the model ranks EOS (id 0) first. tracekit serve emits it and goes on;
    llama.cpp's sampler forbids it (-inf bias) and emits '\\n' (200), its best non-EOS token, while
    the top-k it reports, taken before the sampler, still ranks EOS first: post_eos, each part of
    that checked (analyze/eos_policy.skipped_eos), and the note says why the engines part there."""
    r = diff(SERVE, LLAMA)
    assert r.counts()["identical"] == 2 and r.counts()["post_eos"] == 1 and r.ok
    p = r.by_key("p11")
    assert (p.cls, p.position, p.token_a, p.token_b, p.top1_b) == ("post_eos", 52, 0, 200, 0)
    assert p.below_b == pytest.approx(1.07, abs=0.01)  # nats below llama.cpp's own top-1, the EOS
    assert p.rule.startswith(
        "A emitted EOS 0 at 52; B (llama.cpp, ignore_eos) ranks EOS 0 first there too and took its best "
        "non-EOS token, as its sampler's EOS bias does: B's token 200 lies 1.07 nats below the EOS"
    )
    with TraceReader(LLAMA) as t:
        i = list(t.requests.key).index("p11")
        tok = t.tokens(i)
        assert tok.token_id[52] == 200 and tok.topk_id[52, 0] == 0 and (tok.token_id != 0).all()
    note = _note(r)
    assert note.startswith("A is tracekit serve, B is llama.cpp, both ran with ignore_eos")
    assert "a -inf bias in its sampler: an EOS is never emitted" in note
    assert "the pair parts at that EOS itself, and is post_eos when each part of that is checked" in note
    assert "1 of 3 pair(s) first differ where one side emitted an EOS" in note
    assert "capture both with --no-ignore-eos" in note
    assert f"note: {note}" in text(r).splitlines()  # printed once, as one line
    assert json_doc([r])["notes"].count(note) == 1


def test_the_note_names_each_side_as_it_is():
    """llama.cpp as A: B emitted the EOS (an id of A's run metadata), A skipped it."""
    r = diff(LLAMA, SERVE)
    assert _note(r).startswith("A is llama.cpp, B is tracekit serve, both ran with ignore_eos")
    p = r.by_key("p11")
    assert p.cls == "post_eos" and p.rule.startswith("B emitted EOS 0 at 52; A (llama.cpp, ignore_eos) ranks EOS 0")


def test_without_ignore_eos_there_is_no_note_and_the_engines_agree():
    """The note's advice, followed: both stop at the EOS at 52 (53 tokens), 3/3 identical."""
    r = diff(HERE / "serve.no-ignore-eos.h5", HERE / "llamacpp.no-ignore-eos.h5")
    assert r.counts()["identical"] == 3 and _note(r) == ""
    p = r.by_key("p11")
    assert (p.len_a, p.len_b) == (53, 53)


def test_the_family_is_read_from_the_run_metadata():
    with TraceReader(SERVE) as a, TraceReader(LLAMA) as b:
        assert (family(a.meta), family(b.meta)) == ("tracekit", "llamacpp")


def _meta(fam: str | None, ignore, source: str = "http", **run):
    run = {"engine_family": fam, "sampling": {"ignore_eos": ignore}, **run}
    return SimpleNamespace(source=source, run=run)


@pytest.mark.parametrize(
    "engine,want",
    [
        ({"v1_models": {"owned_by": "llamacpp"}}, "llamacpp"),
        ({"v1_models": {"owned_by": "tiny"}, "info": {"model_id": "tiny"}}, "tgi"),  # TGI: owned_by = model id
        ({"v1_models": {"owned_by": "sglang"}}, "sglang"),
        ({"v1_models": {"owned_by": "acme"}}, "openai"),
    ],
)
def test_older_traces_take_the_family_from_the_engine_report(engine, want):
    """Traces written before `engine_family` was recorded."""
    assert family(_meta(None, True, engine=engine, dialect="openai")) == want


@pytest.mark.parametrize(
    "a,b,said",
    [
        (("vllm", True), ("llamacpp", True), "the pair parts at that EOS itself, and is post_eos when"),
        (("sglang", [False, True]), ("tracekit", False), "both take it, but one stream ends there"),
        (("llamacpp", True), ("tgi", True), "one stream ends with it and the other takes its best non-EOS"),
        (("vllm", True), ("sglang", True), "they part only where a request's own stop tokens do"),
        (("tgi", True), ("vllm", True), "TGI: no ignore_eos switch: it stops at the first EOS"),
        (("acme", True), ("vllm", True), "what its ignore_eos does is not known here"),
    ],
)
def test_each_pair_of_families_gets_its_own_words(a, b, said):
    note = ignore_eos_note(_meta(*a), _meta(*b), {}, ())
    assert said in note and note.count("A is") == 1


@pytest.mark.parametrize(
    "a,b",
    [
        (_meta("vllm", True), _meta("vllm", True)),  # one family: nothing differs
        (_meta("vllm", False), _meta("llamacpp", False)),  # nobody ignored EOS
        (_meta("vllm", True), _meta(None, True, source="teacher_forced")),  # a replay has no EOS policy
    ],
)
def test_no_note(a, b):
    assert ignore_eos_note(a, b, {}, ()) == ""
