"""Red team, ignore_eos across engines: the post_eos verdict for an EOS that llama.cpp skipped.

With ignore_eos llama.cpp puts a -inf logit bias on every end-of-generation token in its sampler:
where the model ranks an EOS first it emits its best non-EOS token, while the logprobs it reports
(taken before the sampler) still rank the EOS first. vLLM, SGLang and tracekit serve emit the EOS
and go on. analyze/eos_policy.skipped_eos calls such a first difference post_eos, and each part of
that claim is checked. Each case below breaks one part (the rest as in the benign case) and must
stay `unexplained`; the benign cases and the real traces of traces/ignore-eos/ must pass.

Why it matters: "llama.cpp skips an EOS" must not become a way to excuse a stream that skipped
its own top-1 for another reason (a vLLM bug, a logit bias, a broken sampler, moved logits).

Builders and the method: redteam_builders.py."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.redteam_builders import (
    BASE,
    EOS,
    GREEDY,
    Case,
    R,
    T,
    Y,
    Z,
    cli_exits_1,
    family_tests,
    flipped,
    judge,
    softmax_row,
    tk,
)

from tracekit.analyze import diff

TRACES = Path(__file__).resolve().parents[2] / "traces" / "ignore-eos"
OTHER_EOS = 3  # a second EOS id, for cases that name two
AFTER = [30, 31, 32]  # what the side that skipped the EOS generated after it


def _run(family: str, ignore_eos: bool | None) -> dict:
    """Run metadata as capture writes it (capture/runmeta.py: engine_family, sampling)."""
    sampling = {"max_tokens": 6, "temperature": 0.0, "top_logprobs": 6, "stream": True}
    if ignore_eos is not None:
        sampling["ignore_eos"] = ignore_eos
    return {"dtype": "bf16", "engine_family": family, "sampling": sampling}


def _params(ignore_eos: bool | None) -> dict:
    return GREEDY if ignore_eos is None else {**GREEDY, "ignore_eos": ignore_eos}


# The model ranks the EOS first at T, 1 nat above Y: the row both engines report.
EOS_FIRST = [(EOS, 20.0), (Y, 19.0)]


def skip_case(
    *,
    row_a=EOS_FIRST,
    row_b=EOS_FIRST,
    tok_a: int = EOS,
    tok_b: int = Y,
    fam_a: str = "tracekit",
    fam_b: str = "llamacpp",
    ign_a: bool | None = True,
    ign_b: bool | None = True,
    eos=(EOS,),
    eos_b=None,
    raw_b: bool = False,
    a: dict | None = None,
    b: dict | None = None,
    expect=("unexplained",),
    words=(),
    nums=(),
    diff_kw=None,
) -> Case:
    """A (fam_a) and B (fam_b) at T: each side's top-k row (id, logit) there and its token; A goes
    on with BASE after T, B with AFTER. a / b: more fields of each side's request (R)."""
    fa = {"tokens": flipped(T, tok_a), "rows": {T: softmax_row(list(row_a))}, "params": _params(ign_a), **(a or {})}
    fb = {"tokens": flipped(T, tok_b)[: T + 1] + AFTER, "rows": {T: softmax_row(list(row_b))}, **(b or {})}
    ra, rb = R(**fa), R(**{"params": _params(ign_b), **fb})
    return Case(
        ra,
        rb,
        opts={"raw": True, "run": _run(fam_a, ign_a), "eos": eos},
        opts_b={"raw": raw_b, "run": _run(fam_b, ign_b), **({"eos": eos_b} if eos_b is not None else {})},
        expect=expect,
        words=words,
        nums=nums,
        diff_kw=diff_kw or {},
    )


LOOSE = {"drift_nats": 3.0}  # candidates may move 3 nats: the case fails on its own check alone


def cases() -> dict[str, Case]:
    """Bugs dressed as llama.cpp's skipped EOS, one part of the claim broken in each."""
    c: dict[str, Case] = {}
    # -- the side that skipped (L) ------------------------------------------------------------------
    # vLLM's ignore_eos emits an EOS that ranks first: a vLLM stream skipping its top-1 is a bug.
    c["l_is_vllm"] = skip_case(fam_b="vllm", words=("B is vLLM, not llama.cpp",))
    # llama.cpp without ignore_eos emits the EOS and stops: taking another token is a bug.
    c["l_without_ignore_eos"] = skip_case(ign_b=False, words=("B's request did not ask ignore_eos",))
    # ... and a request and run that never say whether EOS was ignored.
    c["l_ignore_eos_unknown"] = skip_case(ign_b=None, words=("does not say it asked ignore_eos",))
    # L ranks another EOS id first: the order of the two EOS ids differs between A and B.
    c["l_top1_other_eos"] = skip_case(
        row_a=[(EOS, 20.0), (OTHER_EOS, 19.75), (Y, 19.0)],
        row_b=[(OTHER_EOS, 20.25), (EOS, 20.0), (Y, 19.0)],
        eos=(EOS, OTHER_EOS),
        words=(f"B's own top-1 at {T} is {OTHER_EOS}", f"not the EOS {EOS}"),
    )
    # L ranks its own token first, the EOS 1 nat below (A the other way round): no bias made L
    # skip anything, A and B disagree by 1 nat. Moves are allowed 3 nats: this check alone fails.
    c["l_top1_not_eos"] = skip_case(
        row_b=[(Y, 20.0), (EOS, 19.0)], diff_kw=LOOSE, words=(f"B's own top-1 at {T} is {Y}", "not the EOS")
    )
    # L's token is not its best non-EOS candidate: Z ranks above it.
    three = [(EOS, 20.0), (Z, 19.5), (Y, 19.0)]
    c["l_not_best_non_eos"] = skip_case(
        row_a=three, row_b=three, words=(f"B's token {Y} is not its best non-EOS candidate ({Z})",)
    )
    # L "skipped" an EOS for another EOS id: llama.cpp biases every EOS, it never emits one.
    two_eos = [(EOS, 20.0), (OTHER_EOS, 19.5), (Y, 19.0)]
    c["l_chose_another_eos"] = skip_case(
        row_a=two_eos,
        row_b=two_eos,
        tok_b=OTHER_EOS,
        eos=(EOS, OTHER_EOS),
        words=(f"B's token {OTHER_EOS} is not its best non-EOS candidate ({Y})",),
    )
    # L's top-k row lists an id twice.
    c["l_row_not_sane"] = skip_case(b={"rows": {T: softmax_row(EOS_FIRST) + [(Y, -9.0, 11.0)]}}, words=("twice",))
    # With logits (raw_b): L's logits rank Y first, its logprobs the EOS. Tie tolerance 16 ulp (2
    # nats): the logit and logprob gaps may disagree by that much, so this check alone fails.
    lg_first = [(i, lp, 18.875 if i == EOS else lg) for i, lp, lg in softmax_row(EOS_FIRST)]
    c["l_top1_by_logit_not_eos"] = skip_case(
        raw_b=True,
        b={"rows": {T: lg_first}},
        diff_kw={"tie_ulps": 16},
        words=(f"B's own top-1 at {T} is {Y} (by logprob {EOS}), not the EOS",),
    )
    # ... and the other way round: L's logits rank the EOS first, its logprobs Y.
    lp_y = next(lp for i, lp, _ in softmax_row(EOS_FIRST) if i == Y)
    lp_first = [(i, lp_y - 0.125 if i == EOS else lp, lg) for i, lp, lg in softmax_row(EOS_FIRST)]
    c["l_top1_by_logprob_not_eos"] = skip_case(
        raw_b=True,
        b={"rows": {T: lp_first}},
        diff_kw={"tie_ulps": 16},
        words=(f"B's own top-1 at {T} is {EOS} (by logprob {Y}), not the EOS",),
    )
    # L's logprobs put Y above Z, its logits Z (19.5) above Y (19): Y is not its best non-EOS
    # candidate by logit.
    with_z = softmax_row([(EOS, 20.0), (Y, 19.0), (Z, 19.5)])
    lp_yz = next(lp for i, lp, _ in with_z if i == Y)
    z_low = [(i, lp_yz - 0.125 if i == Z else lp, lg) for i, lp, lg in with_z]
    c["l_best_by_logit_is_another"] = skip_case(
        row_a=[(EOS, 20.0), (Y, 19.0), (Z, 19.5)],
        raw_b=True,
        b={"rows": {T: z_low}},
        words=(f"B's token {Y} is not its best non-EOS candidate ({Z})",),
    )

    # -- the EOS id -----------------------------------------------------------------------------------
    # B's row ties 2 and Y (2 listed first): were 2 not an EOS, Y would be B's best candidate and
    # its top-1 "2" the token A emitted; only the EOS ids tell. Moves allowed 3 nats.
    tied = [(EOS, 20.0), (Y, 20.0)]
    # No EOS id known at all: A's token 2 is no EOS as far as anyone knows.
    c["eos_unknown"] = skip_case(eos=None, row_b=tied, diff_kw=LOOSE, words=("|gap| A 8 ulp",))
    # A's run names EOS 3; only B's names 2. post_eos is a claim about A's EOS ids.
    c["eos_not_a_s"] = skip_case(eos=(OTHER_EOS,), eos_b=(EOS,), row_b=tied, diff_kw=LOOSE, words=("|gap| A 8 ulp",))

    # -- the side that emitted it (S) -----------------------------------------------------------------
    # A's token is an ordinary token (Z), not an EOS, and B skipped it: no ignore_eos explains that.
    c["s_token_not_eos"] = skip_case(
        row_a=[(Z, 20.0), (Y, 19.0)], row_b=[(Z, 20.0), (Y, 19.0)], tok_a=Z, words=(f"below its own top-1 {Z}",)
    )
    # A emitted the EOS although Z was its own top-1 (moves allowed 3 nats: this check alone fails).
    c["s_not_greedy"] = skip_case(
        row_a=[(Z, 20.0), (EOS, 19.875), (Y, 19.0)],
        row_b=[(EOS, 20.0), (Y, 19.0), (Z, 18.0)],
        diff_kw=LOOSE,
        words=(f"A's EOS {EOS} is not its own top-1 ({Z})",),
    )
    # A did not ignore EOS and yet went on past it: no EOS for this engine (or the engine is broken).
    c["s_went_on_without_ignore_eos"] = skip_case(
        ign_a=False, words=(f"A went on past its EOS at {T} although its request did not ignore EOS",)
    )
    # A is llama.cpp with ignore_eos too: it never emits an EOS, yet A's stream holds one.
    c["s_is_llamacpp_with_ignore_eos"] = skip_case(
        fam_a="llamacpp", words=("A is llama.cpp with ignore_eos, which never emits an EOS",)
    )
    # A ran with ignore_eos (TGI cannot) and stopped at the EOS: a stream cut short.
    c["s_stopped_although_ignoring_eos"] = skip_case(
        fam_a="tgi", a={"tokens": flipped(T, EOS)[: T + 1], "finish": "stop"}, words=("3 of 6 tokens asked",)
    )

    # -- the evidence shared with every benign verdict --------------------------------------------------
    # B's logprobs 1 nat below A's at the positions before T.
    low = {t: [(BASE[t], -1.0, 20.0)] + [(1000 + j, -10.0 - j, 11.0 - j) for j in range(4)] for t in range(T)}
    c["drift_before_t"] = skip_case(b={"rows": {**low, T: softmax_row(EOS_FIRST)}}, words=("drift",), nums=(1.0,))
    # B's stream cut at 4 of the 6 tokens asked.
    c["l_truncated"] = skip_case(b={"tokens": flipped(T, Y)[: T + 1] + AFTER[:1]}, words=("4 of 6 tokens asked",))
    # A's stream without a finish reason.
    c["s_truncated"] = skip_case(a={"finish": ""}, words=("without a finish reason",))
    # Y 1.5 nats lower in B than in A: the candidates moved beyond the drift tolerance (0.5 nats).
    c["candidate_moved"] = skip_case(row_b=[(EOS, 20.0), (Y, 17.5)], words=(f"token {Y} moved",))
    # A's logits tell a gap of 1, its logprobs one of 3.
    lying = [(EOS, -0.2, 20.0), (Y, -3.2, 19.0), (1000, -10.2, 10.0)]
    c["s_logits_and_logprobs_disagree"] = skip_case(
        a={"rows": {T: lying}}, diff_kw=LOOSE, words=("A's logits and logprobs disagree",)
    )
    return c


def benign() -> dict[str, Case]:
    """The claim holds: post_eos, and tracekit diff exits 0."""
    ok = ("post_eos",)
    two = [(EOS, 20.0), (OTHER_EOS, 19.5), (Y, 19.0)]
    return {
        # tracekit serve emitted the EOS and went on; llama.cpp took its best non-EOS token.
        "serve_vs_llamacpp": skip_case(
            expect=ok,
            words=(
                f"A emitted EOS {EOS} at {T}; B (llama.cpp, ignore_eos) ranks EOS {EOS} first there too and took "
                "its best non-EOS token, as its sampler's EOS bias does",
                f"B's token {Y} lies 1 nats below the EOS",
                "both streams complete",
            ),
        ),
        # llama.cpp as A (its run names the EOS id), vLLM as B.
        "llamacpp_vs_vllm": skip_case(
            fam_a="llamacpp",
            fam_b="vllm",
            tok_a=Y,
            tok_b=EOS,
            expect=ok,
            words=(f"B emitted EOS {EOS} at {T}; A (llama.cpp, ignore_eos)",),
        ),
        # vLLM without ignore_eos stopped at the EOS; llama.cpp with it went on.
        "s_stopped_at_eos": skip_case(
            fam_a="vllm", ign_a=False, a={"tokens": flipped(T, EOS)[: T + 1], "finish": "stop"}, expect=ok
        ),
        # Two EOS ids; L ranks the one A emitted first and the other second, and took Y.
        "two_eos_ids": skip_case(row_a=two, row_b=two, eos=(EOS, OTHER_EOS), expect=ok),
    }


CASES, BENIGN = cases(), benign()
FIXED: dict[str, str] = {}  # none of these fooled the rule as first written
FOOLED: dict[str, str] = {}  # what fools it today


test_records_name_cases_of_this_family, test_bug_is_not_benign = family_tests(CASES, FIXED, FOOLED)


@pytest.mark.parametrize("name", sorted(BENIGN))
def test_llamacpp_skipped_eos_is_post_eos(tmp_path, name):
    c = BENIGN[name]
    r, p = judge(tmp_path, c)
    assert (p.cls, p.position, r.ok) == ("post_eos", T, True), p.rule
    for w in c.words:
        assert w in p.rule, (w, p.rule)


def test_a_bug_exits_1(tmp_path):
    cli_exits_1(tmp_path, CASES["l_is_vllm"])


def test_real_traces_with_ignore_eos_are_post_eos():
    """traces/ignore-eos: tracekit serve vs llama-server, both --ignore-eos. p11 parts at 52 where
    the model ranks EOS 0 first: post_eos, and `tracekit diff` exits 0, in both directions."""
    for a, b, s in (("serve", "llamacpp", "A"), ("llamacpp", "serve", "B")):
        p = tk("diff", str(TRACES / f"{a}.ignore-eos.h5"), str(TRACES / f"{b}.ignore-eos.h5"), "--json")
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr
        doc = json.loads(p.stdout)
        assert (doc["summary"]["identical"], doc["summary"]["post_eos"]) == (2, 1)
        p11 = next(x for x in doc["pairs"] if x["key"] == "p11")
        assert (p11["class"], p11["position"]) == ("post_eos", 52)
        assert p11["rule"].startswith(f"{s} emitted EOS 0 at 52; ")


def test_real_traces_without_ignore_eos_stay_identical():
    """The --no-ignore-eos control: both stop at that EOS, 3/3 identical, as before the rule."""
    r = diff(TRACES / "serve.no-ignore-eos.h5", TRACES / "llamacpp.no-ignore-eos.h5")
    assert r.counts()["identical"] == 3 and r.ok
    assert [p.len_a for p in r.pairs] == [p.len_b for p in r.pairs]


GRID = st.integers(136, 160).map(lambda n: n / 8)  # logits 17 .. 20 on the BF16 grid near there


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(eos=GRID, y=GRID, z=GRID, raw=st.booleans())
def test_the_rule_holds_exactly_where_the_eos_ranks_first_and_the_token_is_the_best_other(eos, y, z, raw):
    """Both sides report the same row (EOS, Y, Z); A emitted the EOS, llama.cpp's B took Y. It is
    post_eos exactly when the EOS ranks first in it and Y is the best non-EOS candidate (a tie with
    Z allowed); on every other side of those boundaries, unexplained. With and without B's logits."""
    assume(eos not in (y, z))  # an EOS tied for first: which one an engine lists first is its choice
    row = [(EOS, eos), (Y, y), (Z, z)]
    c = skip_case(row_a=row, row_b=row, raw_b=raw, expect=("post_eos", "unexplained"))
    with tempfile.TemporaryDirectory() as d:
        r, p = judge(Path(d), c)
    want = "post_eos" if eos > max(y, z) and y >= z else "unexplained"
    assert p.cls == want, (eos, y, z, p.rule)
