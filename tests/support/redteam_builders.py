"""Red team builders: real bugs dressed as benign divergences, written as real traces.

Every case is built through tracekit's own TraceWriter and schema records (no
mocks, no monkeypatching) and diffed with `tracekit.analyze.diff` (a few also through
the CLI, for the exit code). Each test asserts the *sound* verdict: a bug is
`unexplained` (or `incomparable`) with a rule text naming the numbers, so
`tracekit diff` exits 1; a genuine benign case within the stated tolerance is
benign. Where the classifier is fooled, the case goes in its file's FOOLED
table: the test is marked `xfail(strict=True, reason="fooled: ...")`, CI stays
green, and the fix flips it (strict: an unexpected pass fails, so the entry
must then move to FIXED, the record of each hole and the check that was missing).

The cases live by family: test_redteam_rows.py (the logprob column, logits vs
logprobs, malformed top-k rows, greedy), test_redteam_streams.py (EOS,
truncated streams), test_redteam_requests.py (cached tokens, sampled or
different requests, which rows are compared), test_redteam_grid.py (dtype and
grid, raw-logits drift), test_redteam_benign.py (genuine benign cases and the
bugs just beyond each tolerance), test_redteam_eos_policy.py (the EOS that
llama.cpp's ignore_eos skipped, each part of that post_eos broken alone).

Why it matters: a reviewer merges on "0 unexplained". One arrangement of
numbers that makes a real bug benign, and some engine will produce it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from tracekit.analyze import diff
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = 2
K = 6
BASE = [5, 6, 7, 8, 9, 10]
X, Y, Z = 7, 99, 55  # A's token at the flip, B's token, a third token
T = 2  # the flip position in BASE (BASE[T] == X)


# -- building traces through the real store ---------------------------------------------


def softmax_row(cands: list[tuple[int, float]], filler=(10.0, 9.0, 8.0)) -> list[tuple[int, float, float]]:
    """(id, logprob, logit) from raw logits: logprobs are the log-softmax over the
    candidates and filler ids 1000+ (logits and logprobs tell the same gaps)."""
    vals = [x for _, x in cands] + list(filler)
    m = max(vals)
    z = m + math.log(sum(math.exp(v - m) for v in vals))
    out = [(i, x - z, x) for i, x in cands] + [(1000 + j, x - z, x) for j, x in enumerate(filler)]
    return sorted(out, key=lambda c: -c[2])


def default_row(tok: int) -> list[tuple]:
    """The chosen token far on top (logit 20), filler far below (logits 11, 10, ...)."""
    return softmax_row([(tok, 20.0)], filler=tuple(11.0 - i for i in range(K - 1)))


@dataclass
class R:
    """One request: chosen ids; `rows` overrides the top-k row at a position with
    (id, logprob[, logit]) entries, in the given order; `lp` overrides the stored
    chosen logprob (default: the chosen id's entry in its row)."""

    tokens: list[int]
    rows: dict[int, list[tuple]] = field(default_factory=dict)
    lp: dict[int, float] = field(default_factory=dict)
    key: str = "k"
    cached: int = -1
    prompt: tuple[int, ...] | None = (11, 12, 13, 14)
    phash: str | None = None
    status: str = "ok"
    finish: str = "length"
    params: dict | None = None
    history: str = ""
    dtype: str = ""


def _columns(r: R, k: int, raw: bool) -> TokenColumns:
    n = len(r.tokens)
    ids = np.full((n, k), -1, np.int64)
    lps = np.full((n, k), np.nan, np.float32)
    lgs = np.full((n, k), np.nan, np.float32)
    chosen = np.zeros(n, np.float32)
    for t, tok in enumerate(r.tokens):
        cand = r.rows.get(t, default_row(tok))
        for j, c in enumerate(cand[:k]):
            ids[t, j], lps[t, j] = c[0], c[1]
            lgs[t, j] = c[2] if len(c) > 2 and c[2] is not None else np.nan
        mine = [c[1] for c in cand if c[0] == tok]
        chosen[t] = r.lp.get(t, mine[0] if mine else -0.01)
    return TokenColumns(
        np.array(r.tokens, np.int64), chosen, np.arange(n, dtype=np.float64), ids, lps, lgs if raw else None
    )


def write(path, reqs: list[R], *, raw=False, run=None, eos=(EOS,), k=K, source="http") -> str:
    run = {"dtype": "bf16"} if run is None else dict(run)
    if eos is not None:
        run["eos_token_ids"] = list(eos)
    meta = RunMeta(source=source, run=run, layout=Layout(topk=k, raw_logits=raw))
    items = []
    for r in reqs:
        rec = RequestRecord(
            key=r.key,
            prompt_hash=r.phash if r.phash is not None else prompt_hash(list(r.prompt or ())),
            status=r.status,
            finish_reason=r.finish,
            cached_tokens=r.cached,
            history=r.history,
            dtype=r.dtype,
            http_status=200 if r.status == "ok" else 500,
            params=json.dumps(r.params) if r.params is not None else "",
        )
        items.append((rec, _columns(r, k, raw), r.prompt))
    with TraceWriter(path, meta, expected_tokens=sum(len(r.tokens) for r in reqs) or 1, journal=False) as w:
        w.append_many(items)
    return str(path)


def flipped(t: int, tok: int, tokens=BASE) -> list[int]:
    out = list(tokens)
    out[t] = tok
    return out


@dataclass
class Case:
    a: list[R] | R
    b: list[R] | R
    opts: dict = field(default_factory=dict)  # write options for both sides (raw, run, eos, k, source)
    opts_b: dict = field(default_factory=dict)  # write options for B only (override opts)
    expect: str | tuple[str, ...] = ("unexplained", "incomparable")  # the sound class(es)
    words: tuple[str, ...] = ()  # substrings the rule text must hold
    nums: tuple[float, ...] = ()  # numbers the rule text must name (any format, within 1%)
    diff_kw: dict = field(default_factory=dict)


def build(tmp_path, c: Case) -> tuple[str, str]:
    ra = c.a if isinstance(c.a, list) else [c.a]
    rb = c.b if isinstance(c.b, list) else [c.b]
    a = write(tmp_path / "a.h5", ra, **c.opts)
    b = write(tmp_path / "b.h5", rb, **{**c.opts, **c.opts_b})
    return a, b


def judge(tmp_path, c: Case):
    a, b = build(tmp_path, c)
    r = diff(a, b, **c.diff_kw)
    return r, r.by_key("k")


def tk(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def tie_rows(raw: bool, a=(18.375, 18.375), b=(18.5, 18.25)):
    """The issue's seed flip: A's logits for X / Y, B's for Y / X, as rows (BF16 grid)."""
    ra = softmax_row([(X, a[0]), (Y, a[1])])
    rb = softmax_row([(Y, b[0]), (X, b[1])])
    if not raw:
        ra, rb = [c[:2] for c in ra], [c[:2] for c in rb]
    return ra, rb


def shifted(row: list[tuple], by: float) -> list[tuple]:
    """The same row with every logprob moved by `by` nats (logits unchanged)."""
    return [(c[0], c[1] + by, *c[2:]) for c in row]


# -- the cases -------------------------------------------------------------------------
# Each: the sound verdict, and the words and numbers its rule text must hold. FOOLED
# (below) names the ones today's classifier gets wrong, with the wrong verdict it gives.

GREEDY = {"temperature": 0.0, "max_tokens": 6}
NAN6 = {t: math.nan for t in range(6)}


GREEDY = {"temperature": 0.0, "max_tokens": 6}
NAN6 = {t: math.nan for t in range(6)}


def marked(names, table, what):
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"{what}: {table[n]}")) if n in table else n
        for n in names
    ]


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.IGNORECASE)


def names_number(text: str, x: float) -> bool:
    """Whether the text holds |x| as a number, in any format, within 1% (or 0.01)."""
    return any(abs(abs(float(m)) - abs(x)) <= max(0.01 * abs(x), 0.01) for m in NUMBER.findall(text))


def assert_sound(r, p, c: Case) -> None:
    expect = (c.expect,) if isinstance(c.expect, str) else c.expect
    assert p.cls in expect, (p.cls, p.rule)
    assert not r.ok, "a bug must make tracekit diff exit 1"
    for w in c.words:
        assert w in p.rule, (w, p.rule)
    for x in c.nums:
        assert names_number(p.rule, x), (x, p.rule)


def records_hold(cases: dict, fixed: dict, fooled: dict) -> None:
    """FIXED and FOOLED name cases of their own file, and no case is in both."""
    assert set(fixed) <= set(cases) and set(fooled) <= set(cases) and not set(fixed) & set(fooled)


def cli_exits_1(tmp_path, c: Case) -> None:
    """The exit code a reviewer sees: `tracekit diff --json` exits 1, the pair is not benign."""
    a, b = build(tmp_path, c)
    p = tk("diff", a, b, "--json")
    assert p.returncode in (0, 1), p.stderr
    pair = next(x for x in json.loads(p.stdout)["pairs"] if x["key"] == "k")
    assert p.returncode == 1, pair["rule"]
    assert pair["class"] in ("unexplained", "incomparable"), pair["rule"]


def family_tests(cases: dict, fixed: dict, fooled: dict):
    """The two tests every family file runs, bound to its tables (assign them to module names
    starting with `test_` and pytest collects them): its records name its own cases, and no bug
    is benign (a FOOLED case is an xfail, strict)."""

    def test_records_name_cases_of_this_family():
        records_hold(cases, fixed, fooled)

    @pytest.mark.parametrize("name", marked(cases, fooled, "fooled"))
    def test_bug_is_not_benign(tmp_path, name):
        c = cases[name]
        r, p = judge(tmp_path, c)
        assert_sound(r, p, c)

    return test_records_name_cases_of_this_family, test_bug_is_not_benign
