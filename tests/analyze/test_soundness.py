"""The bugs issue 12 found called benign, each rebuilt through the project's own
TraceWriter and run through the real CLI: every one must now be `unexplained`
(or `incomparable`), exit 1, with a rule text that names the numbers. And the
user's seed flip (BF16 logits 18.375/18.375 -> 18.5/18.25) must stay a
`bf16_tie_flip`, with raw logits and with logprobs alone.

Why it matters: a reviewer merges on "0 unexplained". A classifier that calls
one real bug benign with exit 0 is the worst defect this tool can have.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import h5py
import pytest
from support.analyze_builders import EOS, Req, flip, logit_row, write_trace

from tracekit.analyze import assert_equivalent, diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [5, 6, 7, 8, 9, 10]
ANCHOR = Req("anchor", [5, 6])


def tk(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def flipped(t: int, b_tok: int, tokens=BASE) -> list[int]:
    out = list(tokens)
    out[t] = b_tok
    return out


def pair(tmp_path, ra: Req, rb: Req, raw=False, run=None, run_b=None, eos=(EOS,)) -> tuple[str, str]:
    run = {"dtype": "bf16"} if run is None else run
    a = write_trace(tmp_path / "a.h5", [ANCHOR, ra], raw=raw, run=run, eos=eos, k=9)
    b = write_trace(tmp_path / "b.h5", [ANCHOR, rb], raw=raw, run=run if run_b is None else run_b, eos=eos, k=9)
    return a, b


def cli_pair(a: str, b: str, *args: str) -> tuple[int, dict]:
    p = tk("diff", a, b, "--json", *args)
    assert p.returncode in (0, 1), p.stderr
    d = json.loads(p.stdout)
    return p.returncode, next(x for x in d["pairs"] if x["key"] != "anchor")


def _ln_softmax(vals):
    m = max(vals)
    z = m + math.log(sum(math.exp(v - m) for v in vals))
    return [v - z for v in vals]


# Each case: (A request, B request, write options, expected class, substrings of the rule).
def cases():
    out = {}
    # 1. Non-greedy choice dressed as a tie: A's candidates tied; B's token tied with A's
    # token inside B's top-k, but B's top-1 (55) is 11 nats above both; A's token fell from
    # -0.69 to -11.75 between the traces.
    a_row = flip(7, 99, -0.69, -0.70)
    b_row = [(55, -0.0001), (99, -11.75), (7, -11.75)] + [(1000 + i, -12.0 - i) for i in range(6)]
    out["nongreedy"] = (
        Req("k", BASE, rows={2: a_row}),
        Req("k", flipped(2, 99), rows={2: b_row}),
        {},
        "unexplained",
        [
            "B chose token 99, 11.7 nats below its own top-1 55",
            "token 7 moved -11.1 nats from A to B (> 0.5 nats, bf16)",
        ],
    )
    # The same with raw logits: B's top-1 at 20.0, both candidates at 8.5 (152 BF16 steps).
    out["nongreedy_logits"] = (
        Req("k", BASE, rows={2: logit_row([(7, 8.5), (99, 8.5)])}),
        Req("k", flipped(2, 99), rows={2: logit_row([(55, 20.0), (99, 8.5), (7, 8.5)])}),
        {"raw": True},
        "unexplained",
        ["B chose token 99, 152 ulp below its own top-1 55 (greedy: its own top-1, ties allowed)"],
    )
    # 2. Logits tie (0 and 2 steps) while the logprobs of the same tokens are 3 nats apart.
    out["logits_vs_logprobs"] = (
        Req("k", BASE, rows={2: [(7, -0.05, 16.0), (99, -3.05, 16.0)] + [(1000, -6.0, 9.0)]}),
        Req("k", flipped(2, 99), rows={2: [(99, -0.05, 16.25), (7, -3.05, 16.0)] + [(1000, -6.0, 9.0)]}),
        {"raw": True},
        "unexplained",
        ["A's logits and logprobs disagree: logit gap 0, logprob gap 3 nats (differ by 3 > 0.5)"],
    )
    # 3. An FP32 run flipping at logits 18.3 / 18.0: 157,286 FP32 steps, not a tie.
    out["fp32_grid"] = (
        Req("k", BASE, rows={2: logit_row([(7, 18.3), (99, 18.0)])}),
        Req("k", flipped(2, 99), rows={2: logit_row([(99, 18.3), (7, 18.0)])}),
        {"raw": True, "run": {"dtype": "fp32"}},
        "unexplained",
        [
            "|gap| A 1.57e+05 ulp, B 1.57e+05 ulp beyond the tie tolerance 64 ulp (fp32), boundaries unknown (? vs ?)",
            "(> 256 ulp, fp32)",
        ],
    )
    # 4a. No EOS id known: a stop row ending in a common token (77) no longer turns it into an
    # EOS for every pair; B's token outside A's top-k is a bug.
    out["eos_guess"] = (
        Req("k", [5, 77, 8, 9], finish="stop"),
        Req("k", [5, 77, 4242, 9], finish="stop"),
        {"eos": None},
        "unexplained",
        ["B's token 4242 not in A's top-k"],
    )
    # 4b. ... nor does a stream that B cut short and labelled "stop" excuse itself.
    out["cut_short_stop"] = (
        Req("k", BASE, finish="length"),
        Req("k", BASE[:3], finish="stop"),
        {"eos": None},
        "unexplained",
        ["length mismatch: 6 vs 3 tokens, identical up to 3, no EOS before (EOS ids unknown)"],
    )
    # 4c. EOS known and ignored (--ignore-eos): B stopped at 3 of 6 tokens with "stop": truncated.
    ask = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    out["truncated"] = (
        Req("k", [5, EOS, 7, 8, 9, 10], params=ask),
        Req("k", [5, EOS, 7], params=ask, finish="stop"),
        {},
        "unexplained",
        ["B's stream stopped (stop) after 3 of 6 tokens asked although EOS was ignored"],
    )
    out["no_finish_reason"] = (
        Req("k", [5, EOS, 7, 8, 9, 10], params=ask),
        Req("k", [5, EOS, 7, 8], params=ask, finish=""),
        {},
        "unexplained",
        ["B's stream ended after 4 tokens without a finish reason"],
    )
    # 5a. Same ids, a 6-nat drift.
    out["drift_identical"] = (
        Req("k", BASE, lp={3: -6.0}),
        Req("k", BASE),
        {},
        "unexplained",
        ["same 6 token ids, but logprobs drift 5.99 nats > 0.5 (bf16)"],
    )
    # 5b. A 0.49-nat shift at every position (p 0.99 -> 0.60), then a tie.
    n = 20
    toks = [5 + (i % 6) for i in range(n)]
    tie_t = n - 1
    out["systematic_drift"] = (
        Req("k", toks, rows={tie_t: flip(toks[tie_t], 99, -0.7, -0.75)}),
        Req(
            "k",
            flipped(tie_t, 99, toks),
            lp={i: -0.50 for i in range(tie_t)},
            rows={tie_t: flip(99, toks[tie_t], -0.7, -0.75)},
        ),
        {},
        "unexplained",
        ["mean drift 0.49 nats over 19 positions before the flip > 0.0855"],
    )
    # 5c. A NaN logprob on one side at the drifting position does not hide the drift.
    out["nan_hides_drift"] = (
        Req("k", BASE, lp={3: -6.0}),
        Req("k", BASE, lp={3: float("nan")}),
        {},
        "unexplained",
        ["a logprob is NaN/inf on one side only at 1 position(s), first at 3 (A -6 vs B nan)"],
    )
    # Grid: 16 vs 15.5 is 8 BF16 steps (15.5..16 is spaced 1/16), not a 4-ULP tie.
    out["grid_power_of_two"] = (
        Req("k", BASE, rows={2: logit_row([(7, 16.0), (99, 15.5)])}),
        Req("k", flipped(2, 99), rows={2: logit_row([(99, 16.0), (7, 15.5)])}),
        {"raw": True},
        "unexplained",
        ["|gap| A 8 ulp, B 8 ulp beyond the tie tolerance 4 ulp (bf16)"],
    )
    # Unknown dtype, raw logits off the BF16 grid: judged on FP32 (said), so 18.3/18.0 is a bug.
    out["grid_inferred_fp32"] = (
        Req("k", BASE, rows={2: logit_row([(7, 18.3), (99, 18.0)])}),
        Req("k", flipped(2, 99), rows={2: logit_row([(99, 18.3), (7, 18.0)])}),
        {"raw": True, "run": {}},
        "unexplained",
        ["beyond the tie tolerance 64 ulp (fp32)"],
    )
    # Unknown ids (-1, a strings-only engine captured without --tokenizer) never compare equal.
    out["unknown_ids"] = (
        Req("k", [-1] * 6, rows={t: [(-1, -0.1)] for t in range(6)}),
        Req("k", [-1] * 6, rows={t: [(-1, -0.1)] for t in range(6)}),
        {},
        "incomparable",
        ["token ids unknown (-1) at 6 of 6 positions of A", "--tokenizer DIR"],
    )
    # A sampled request is not comparable token by token.
    out["sampled"] = (
        Req("k", BASE, params={"temperature": 0.0}),
        Req("k", flipped(2, 99), params={"temperature": 0.7}),
        {},
        "incomparable",
        ["sampled: B's request has temperature 0.7"],
    )
    return out


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
def test_bug_is_not_benign_via_the_cli(tmp_path, name):
    ra, rb, opts, expect, words = CASES[name]
    a, b = pair(tmp_path, ra, rb, **opts)
    rc, p = cli_pair(a, b)
    assert rc == 1, p
    assert p["class"] == expect, p["rule"]
    for w in words:
        assert w in p["rule"], (w, p["rule"])


def test_unknown_eos_is_said_in_every_output(tmp_path):
    ra, rb, opts, _, _ = CASES["eos_guess"]
    a, b = pair(tmp_path, ra, rb, **opts)
    d = json.loads(tk("diff", a, b, "--json").stdout)
    assert d["eos_token_ids"] == [] and d["eos_source"].startswith("unknown: post_eos cannot fire; pass --eos ID")
    for fmt in ((), ("--markdown",)):
        out = tk("diff", a, b, *fmt).stdout
        assert "EOS ids unknown: post_eos cannot fire; pass --eos ID or --tokenizer DIR" in out


def test_nan_is_counted_as_a_finding(tmp_path):
    ra, rb, opts, _, _ = CASES["nan_hides_drift"]
    a, b = pair(tmp_path, ra, rb, **opts)
    p = tk("diff", a, b)
    assert "findings: 1 pair(s) with a NaN/inf logprob on one side only (1 position(s))" in p.stdout
    d = json.loads(tk("diff", a, b, "--json").stdout)
    assert d["findings"]["nonfinite_pairs"] == 1 and d["pairs"][1]["nonfinite"] == 1


def test_drift_fails_assert_equivalent(tmp_path):
    """`assert_equivalent(..., allow=())` passed with a 6-nat drift: no longer."""
    ra, rb, opts, _, _ = CASES["drift_identical"]
    a, b = pair(tmp_path, ra, rb, **opts)
    with pytest.raises(AssertionError, match="logprobs drift 5.99 nats"):
        assert_equivalent(a, b, allow=())


def test_logits_refute_a_wrong_dtype_label(tmp_path):
    """The FP32 case's numbers, labelled BF16: 18.3 is no BF16 number, so the label is
    refuted and the pair judged on FP32 (said). Only the user's explicit --dtype bf16
    makes it the 2.4-step BF16 tie those numbers would be on that grid."""
    ra, rb, _, _, _ = CASES["fp32_grid"]
    a, b = pair(tmp_path, ra, rb, raw=True, run={"dtype": "bf16"})
    r = diff(a, b)
    p = r.by_key("k")
    assert p.cls == "unexplained" and (p.dtype_a, p.dtype_b) == ("fp32", "fp32")
    assert any("raw logits are not on that grid: judged on fp32" in n for n in r.notes)
    p = diff(a, b, dtype="bf16").by_key("k")
    assert p.cls == "bf16_tie_flip" and p.gap_a_ulp == pytest.approx(2.4, abs=1e-3)


def test_unknown_dtype_says_which_grid_it_assumed(tmp_path):
    ra, rb = Req("k", BASE), Req("k", BASE)
    a, b = pair(tmp_path, ra, rb, run={})
    r = diff(a, b)
    assert r.grids["a"].dtype == "bf16" and not r.grids["a"].known
    assert any(n.startswith("A: dtype bf16 (assumed: the run metadata names no dtype") for n in r.notes)
    out = tk("diff", a, b).stdout
    assert "grid bf16 (assumed: the run metadata names no dtype; pass --dtype to set it)" in out
    ra, rb, opts, _, _ = CASES["grid_inferred_fp32"]
    a, b = pair(tmp_path, ra, rb, **opts)
    assert diff(a, b).grids["a"].source == "inferred: the raw logits are not on the BF16 or FP16 grid"


# -- the seed flip: benign, with raw logits and with logprobs only ----------------------


def _seed(raw: bool):
    others = [10.0, 9.0, 8.0]

    def row(first, second, la, lb):
        lps = _ln_softmax([la, lb, *others])
        cand = [(first, lps[0], la), (second, lps[1], lb)] + [(1000 + i, lps[2 + i], o) for i, o in enumerate(others)]
        return cand if raw else [c[:2] for c in cand]

    ra = Req("seed", BASE, rows={2: row(7, 99, 18.375, 18.375)})
    rb = Req("seed", flipped(2, 99), rows={2: row(99, 7, 18.5, 18.25)})
    return ra, rb


@pytest.mark.parametrize("raw", [True, False], ids=["raw_logits", "logprobs_only"])
def test_seed_flip_is_a_bf16_tie_flip(tmp_path, raw):
    """BF16 logits 18.375/18.375 in A became 18.5/18.25 in B: 0 and 2 steps, each moved one step."""
    ra, rb = _seed(raw)
    a, b = pair(tmp_path, ra, rb, raw=raw)
    rc, p = cli_pair(a, b)
    assert rc == 0 and p["class"] == "bf16_tie_flip", p["rule"]
    if raw:
        assert (p["gap_a_ulp"], p["gap_b_ulp"], p["move_a_ulp"], p["move_b_ulp"]) == (0.0, 2.0, -1.0, 1.0)
        assert "|gap| A 0 ulp <= 4 ulp, B 2 ulp <= 4 ulp" in p["rule"]
    else:
        assert p["gap_a"] == pytest.approx(0, abs=1e-6) and p["gap_b"] == pytest.approx(0.25, abs=1e-6)
        assert "B 0.25 nats <= 0.5 nats" in p["rule"]


def test_near_zero_logits_use_the_floor(tmp_path):
    """0 vs -0.0078 at the top of a row is one BF16 step at the floor |x| = 1, not 256."""
    ra = Req("k", BASE, rows={2: logit_row([(7, 0.0), (99, -0.0078125)], filler=(-4.0, -5.0))})
    rb = Req("k", flipped(2, 99), rows={2: logit_row([(99, 0.0), (7, -0.0078125)], filler=(-4.0, -5.0))})
    a, b = pair(tmp_path, ra, rb, raw=True)
    p = diff(a, b).by_key("k")
    assert p.cls == "bf16_tie_flip" and p.gap_a_ulp == 1.0


# -- one bad comparison must not hide the others; duplicates are said ----------------


def test_diff_a_b_c_prints_a_vs_b_when_c_shares_no_key(tmp_path):
    a = write_trace(tmp_path / "a.h5", [Req("x", BASE)], run={"dtype": "bf16"})
    b = write_trace(tmp_path / "b.h5", [Req("x", BASE)], run={"dtype": "bf16"})
    c = write_trace(tmp_path / "c.h5", [Req("y", BASE)], run={"dtype": "bf16"})
    p = tk("diff", a, b, c)
    assert p.returncode == 3
    assert "1/1 identical" in p.stdout and "comparison failed" in p.stdout
    assert p.stderr.startswith("Error: ") and "no request key in common" in p.stderr
    d = json.loads(tk("diff", a, b, c, "--json").stdout)
    assert d["comparisons"][0]["summary"]["identical"] == 1
    assert "no request key in common" in d["comparisons"][1]["error"]


def test_duplicate_keys_are_said_per_file(tmp_path):
    """A trace holding a key twice (an older capture; today's writer refuses it) keeps
    the last row, and every output says so, per file."""
    a = write_trace(tmp_path / "a.h5", [Req("ka", BASE), Req("kb", BASE)], run={"dtype": "bf16"})
    with h5py.File(a, "r+") as f:  # rename kb -> ka in the ragged key column (same length)
        kb = f["requests/key_bytes"]
        kb[...] = list(kb[...].tobytes().replace(b"kb", b"ka"))
    b = write_trace(tmp_path / "b.h5", [Req("ka", BASE)], run={"dtype": "bf16"})
    d = json.loads(tk("diff", a, b, "--json").stdout)
    assert any("A (" in n and "1 key(s) appear more than once (ka x2, 2 rows)" in n for n in d["notes"])
    assert "appear more than once" in tk("diff", a, b).stdout
    assert "appear more than once" in tk("diff", a, b, "--markdown").stdout


def test_only_filters_json_too(tmp_path):
    ra, rb, _, _, _ = CASES["drift_identical"]
    a, b = pair(tmp_path, ra, rb)
    d = json.loads(tk("diff", a, b, "--json", "--only", "unexplained").stdout)
    assert [p["key"] for p in d["pairs"]] == ["k"] and d["only"] == ["unexplained"]
    assert d["summary"]["pairs"] == 2 and d["summary"]["identical"] == 1
    assert "--only unexplained: listing 1 of 2 pairs" in tk("diff", a, b, "--only", "unexplained").stdout


def test_logits_only_traces_measure_drift_on_logits(tmp_path):
    """vLLM --logprobs-mode raw_logits: no logprob is stored, only raw logits. Drift is
    then measured on the chosen tokens' logits, so a 6-logit jump is still caught."""
    nan = float("nan")
    quiet = {t: nan for t in range(6)}

    def req(logit3):
        rows = {t: [(tok, nan, 10.0), (1000, nan, 4.0)] for t, tok in enumerate(BASE)}
        rows[3] = [(BASE[3], nan, logit3), (1000, nan, 4.0)]
        return Req("k", BASE, lp=quiet, rows=rows)

    def files(logit3):
        run = {"dtype": "bf16"}
        a = write_trace(tmp_path / "a.h5", [req(10.0)], raw=True, run=run)
        return a, write_trace(tmp_path / "b.h5", [req(logit3)], raw=True, run=run)

    r = diff(*files(10.0))
    assert r.by_key("k").cls == "identical" and any("raw logits" in n for n in r.notes)
    p = diff(*files(16.0)).by_key("k")
    assert p.cls == "unexplained" and "raw logits drift 96 ulp (a logit moved by 6) > 4 (bf16)" in p.rule
