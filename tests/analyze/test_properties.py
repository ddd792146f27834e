"""Property-based tests of the classifier's soundness (hypothesis).

Generators build, on each dtype's own grid, benign divergences within the
stated tolerances (a near-tie whose candidates moved by at most the tolerance,
a difference after a sound EOS prefix, a numeric-size gap at a changed prefix
boundary, identical tokens with bounded drift) and bugs that each differ from a
benign case by one flaw (a non-greedy choice, movement beyond tolerance, a token
outside the top-k, the lower of two near-tied candidates, logits and logprobs that
disagree, systematic drift, a large
drift spike, truncation, a NaN that would hide drift, a gap beyond the tie at an
unchanged boundary). Properties: no generated bug is ever benign; every generated
benign case is benign (and in its class).

To keep thousands of pairs fast, each hypothesis example writes ONE pair of
traces (through the real TraceWriter) holding a whole batch of pairs, and diffs
them once. Why it matters: the verdict is the product; a rule that can be fooled
by some arrangement of numbers will be, on some engine.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.analyze_builders import EOS, Req, write_trace

from tracekit.analyze import Thresholds, diff

BUGS = ("nongreedy", "lower", "moved", "outside", "mismatch", "systematic", "spike", "truncated", "nan", "gap")
BENIGN = ("tie", "post_eos", "boundary", "identical")
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
X, Y, Z = 7, 99, 55  # A's token, B's token, a third token


def grid_down(v: float, n: int, dtype: str) -> float:
    """The value n steps below v (> 0, on the grid) on the dtype's grid, exactly."""
    if dtype == "bf16":
        u = (np.array([v], np.float32).view(np.uint32) >> 16).astype(np.int64) - n
        return float((u.astype(np.uint32) << 16).view(np.float32)[0])
    if dtype == "fp16":
        u = np.array([v], np.float16).view(np.uint16).astype(np.int64) - n
        return float(u.astype(np.uint16).view(np.float16)[0])
    u = np.array([v], np.float32).view(np.uint32).astype(np.int64) - n
    return float(u.astype(np.uint32).view(np.float32)[0])


def on_grid(v: float, dtype: str) -> float:
    return float({"bf16": _bf16, "fp16": np.float16, "fp32": np.float32}[dtype](v))


def _bf16(v: float) -> float:
    u = np.array([v], np.float32).view(np.uint32)
    return float(((u + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)[0])


def row(logits: dict[int, float], with_logits: bool, rest: float, lp_shift: dict[int, float] | None = None):
    """A top-k row: ids by descending logit, logprobs = log-softmax over them plus the
    mass `rest` (log) of unseen tokens; optionally logprobs moved off the logits."""
    vals = list(logits.values()) + [rest]
    m = max(vals)
    lse = m + math.log(sum(math.exp(v - m) for v in vals))
    out = []
    for i, x in sorted(logits.items(), key=lambda kv: -kv[1]):
        lp = x - lse + (lp_shift or {}).get(i, 0.0)
        out.append((i, lp, x) if with_logits else (i, lp))
    return out


@dataclass
class Case:
    kind: str
    a: Req
    b: Req


@st.composite
def flip_numbers(draw, dtype: str, with_logits: bool, tol, kind: str):
    """Logits at the first difference: (A's row logits, B's row logits) on the grid."""
    T, D = int(tol.tie_ulps), int(tol.drift_ulps)
    hi = 47.0 if with_logits else 31.0  # logprobs only: the nats tolerances assume |logit| < 32
    v0 = on_grid(draw(st.floats(2.5, hi)), dtype)
    if kind == "boundary" and with_logits:
        ga, gb = draw(st.integers(0, D)), draw(st.integers(0, D))
    elif with_logits:
        ga, gb = draw(st.integers(0, T)), draw(st.integers(0, T))
    else:  # so that each candidate's logprob moves by at most the nats tolerance
        ga = draw(st.integers(0, T // 2))
        gb = draw(st.integers(0, T // 2 - ga))
    dx = draw(st.integers(max(0, ga + gb - D), min(ga + gb, D)))  # x moves down dx, y up (ga+gb-dx)
    xa, ya = v0, grid_down(v0, ga, dtype)
    xb = grid_down(xa, dx, dtype)
    yb = grid_down(xb, -gb, dtype)  # gb steps above xb
    low = grid_down(v0, max(D, T) + 8, dtype) - 1.0  # fillers well below both candidates
    fill = {1000 + j: low - j for j in range(3)}
    return {X: xa, Y: ya, **fill}, {Y: yb, X: xb, **fill}, v0 - 3.0


@st.composite
def drift_noise(draw, n: int, tol):
    """n chosen logprobs of A and of B over the prefix: one spike up to the max
    tolerance, the rest within the mean tolerance (10% margin for float32 rounding)."""
    # below -drift_nats, so that A's and B's logprobs stay <= 0 (a sane engine's report) whatever the noise
    base = [-draw(st.floats(tol.drift_nats + 0.001, tol.drift_nats + 0.5)) for _ in range(n)]
    if not n:
        return [], []
    spike = draw(st.integers(0, n - 1))
    d = [draw(st.floats(0, 0.9 * tol.drift_mean_nats)) for _ in range(n)]
    d[spike] = draw(st.floats(0, 0.9 * tol.drift_nats))
    sign = [draw(st.sampled_from((-1, 1))) for _ in range(n)]
    b = [float(np.float32(x + s * dd)) for x, s, dd in zip(base, sign, d)]
    return base, b


@st.composite
def case(draw, key: str, dtype: str, kind: str):
    tol = Thresholds().for_dtype(dtype)
    with_logits = draw(st.booleans())
    n_pre = draw(st.integers(2 if kind == "systematic" else 0, 12))
    pre = [5 + (i % 7) for i in range(n_pre)]
    lp_a, lp_b = draw(drift_noise(n_pre, tol))
    a_lp = dict(enumerate(lp_a))
    b_lp = dict(enumerate(lp_b))
    tail_a, tail_b = [20, 21, 22], [30, 31, 32]
    t = n_pre
    if kind in ("identical",):
        return Case(kind, Req(key, pre + [X], lp=a_lp), Req(key, pre + [X], lp=b_lp))
    if kind in ("post_eos", "truncated"):
        e = draw(st.integers(0, max(0, n_pre - 1))) if n_pre else None
        toks = pre + [EOS] if e is None else pre[:e] + [EOS] + pre[e + 1 :]
        e_pos = toks.index(EOS)
        n = len(toks) + 4
        ask = {"max_tokens": n, "ignore_eos": True, "temperature": 0.0}
        a = Req(key, toks + tail_a + [9], lp=a_lp, params=ask)
        if kind == "post_eos":
            b = Req(key, toks + tail_b + [9], lp=b_lp, params=ask)  # anything after the EOS
        else:
            m = draw(st.integers(e_pos + 1, n - 1))
            how = draw(st.sampled_from(("", "stop", "length")))
            b = Req(key, (toks + tail_a + [9])[:m], lp=b_lp, params=ask, finish=how)
        return Case(kind, a, b)
    ra, rb, rest = draw(flip_numbers(dtype, with_logits or kind == "mismatch", tol, kind))
    with_logits = with_logits or kind == "mismatch"
    ca, cb = 16, 16
    if kind == "boundary":
        cb = draw(st.sampled_from((0, 4, 8)))
    shift_b: dict[int, float] = {}
    if kind == "nongreedy":  # a third token above B's choice by more than the tie tolerance
        if with_logits:
            rb = {Z: grid_down(rb[Y], -draw(st.integers(int(tol.tie_ulps) + 1, 200)), dtype), **rb}
        else:  # judged in nats: above by more than --tie-nats
            rb = {Z: rb[Y] + draw(st.floats(1.01, 40.0)) * tol.tie_nats + 1e-6, **rb}
    elif kind == "lower":  # B chose the lower of the two, within what a tie tolerance would allow
        if with_logits:
            rb = {**rb, X: grid_down(rb[Y], -draw(st.integers(1, int(tol.tie_ulps))), dtype)}
        else:
            # above the float32 resolution of a logprob (and the greedy check's 1e-6 slack)
            rb = {**rb, X: rb[Y] + draw(st.floats(1e-5, tol.tie_nats))}
    elif kind == "moved":  # both candidates moved together beyond the drift tolerance
        m = draw(st.integers(int(tol.drift_ulps) + 1, 400)) if with_logits else None
        if with_logits:
            rb = {k: (grid_down(v, -m, dtype) if k in (X, Y) else v) for k, v in rb.items()}
        else:  # logprobs only: lost probability mass to unseen tokens
            extra = draw(st.floats(2.05 * tol.drift_nats + 1e-3, 12.0))
            shift_b = {X: -extra, Y: -extra}
    elif kind == "outside":
        rb = {(4242 if k == Y else k): v for k, v in rb.items()}
    elif kind == "mismatch":  # logits tie, logprob gap told differently
        spacing = 2.0 ** (math.floor(math.log2(abs(ra[X]))) - {"bf16": 7, "fp16": 10, "fp32": 23}[dtype])
        off = draw(st.floats(1.5, 50.0)) * tol.tie_ulps * spacing * 2
        shift_b = {X: -off}
    elif kind == "gap":  # beyond the tie tolerance in B, boundaries unchanged
        over = draw(st.integers(int(tol.tie_ulps) + 1, 300)) if with_logits else None
        if with_logits:
            rb = {**rb, X: grid_down(rb[Y], over, dtype)}
        else:
            shift_b = {X: -draw(st.floats(1.01 * tol.tie_nats + 1e-6, 5.0))}
    b_tok = 4242 if kind == "outside" else Y
    a_row = row(ra, with_logits, rest)
    b_row = row(rb, with_logits, rest, shift_b)
    if kind == "systematic":  # every prefix position moved: within the max, beyond the mean bound
        s = draw(st.floats(0.62, 1.0)) * tol.drift_nats
        b_lp = {p: float(np.float32(a_lp[p] - s)) for p in range(n_pre)}
    elif kind == "spike":
        b_lp = dict(b_lp)
        p = draw(st.integers(0, n_pre)) if n_pre else None
        if p is None or p == n_pre:
            pre, n_pre, t = pre + [11], n_pre + 1, t + 1
            a_lp[n_pre - 1] = -0.01
            p = n_pre - 1
        b_lp[p] = float(np.float32(a_lp[p] - draw(st.floats(1.01, 20.0)) * tol.drift_nats))
    elif kind == "nan":
        if not n_pre:
            pre, n_pre, t = [11], 1, 1
            a_lp = {0: -0.01}
        b_lp = dict(b_lp)
        b_lp[draw(st.integers(0, n_pre - 1))] = draw(st.sampled_from((math.nan, -math.inf, math.inf)))
    prompt = tuple(range(11, 35))  # 24 tokens: the boundaries 0..16 lie inside it
    a = Req(key, pre + [X] + tail_a, lp=a_lp, rows={t: a_row}, cached=ca, prompt=prompt)
    b = Req(key, pre + [b_tok] + tail_b, lp=b_lp, rows={t: b_row}, cached=cb, prompt=prompt)
    return Case(kind, a, b)


@st.composite
def batch(draw, kinds: tuple[str, ...]):
    dtype = draw(st.sampled_from(("bf16", "fp16", "fp32")))
    n = draw(st.integers(10, 40))
    chosen = [draw(st.sampled_from(kinds)) for _ in range(n)]
    return dtype, [draw(case(f"p{i}", dtype, k)) for i, k in enumerate(chosen)]


def run_batch(dtype: str, cases: list[Case]):
    with tempfile.TemporaryDirectory() as d:
        run = {"dtype": dtype}
        a = write_trace(Path(d) / "a.h5", [c.a for c in cases], k=9, raw=True, run=run)
        b = write_trace(Path(d) / "b.h5", [c.b for c in cases], k=9, raw=True, run=run)
        return diff(a, b)


@settings(max_examples=80, **SETTINGS)
@given(batch(BUGS))
def test_no_generated_bug_is_benign(data):
    dtype, cases = data
    r = run_batch(dtype, cases)
    for c in cases:
        p = r.by_key(c.a.key)
        assert p.cls == "unexplained", f"{dtype} {c.kind}: {p.cls}: {p.rule}"


EXPECT = {
    "tie": {"bf16_tie_flip"},
    "boundary": {"cache_boundary", "bf16_tie_flip"},
    "post_eos": {"post_eos"},
    "identical": {"identical"},
}


@settings(max_examples=80, **SETTINGS)
@given(batch(BENIGN))
def test_every_generated_benign_case_is_benign(data):
    dtype, cases = data
    r = run_batch(dtype, cases)
    for c in cases:
        p = r.by_key(c.a.key)
        assert p.cls in EXPECT[c.kind], f"{dtype} {c.kind}: {p.cls}: {p.rule}"
