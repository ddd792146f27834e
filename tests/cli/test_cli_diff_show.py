"""`tracekit diff` and `tracekit show` as a user runs them (real processes, real files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.analyze_builders import EOS, Req, flip, write_trace

from tracekit.analyze import assert_equivalent

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [5, 6, 7, 8, 9]


def tk(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A real (word-level) tokenizers tokenizer: ids 5..9 are words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": EOS, "the": 5, "cat": 6, "sat": 7, "on": 8, "mats": 9, "dog": 99}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("cli")
    run = {"tokenizer": tokenizer_dir}
    tie_a, tie_b = {2: flip(7, 99, -0.7, -0.75)}, {2: flip(99, 7, -0.7, -0.75)}
    a = [Req("same", BASE), Req("tie", BASE, rows=tie_a), Req("eos", [5, EOS, 7]), Req("bug", BASE)]
    b = [
        Req("same", BASE),
        Req("tie", [5, 6, 99, 8, 9], rows=tie_b),
        Req("eos", [5, EOS, 8]),
        Req("bug", [5, 6, 7, 4242, 9]),
    ]
    ok_b = [Req("same", BASE), Req("tie", [5, 6, 99, 8, 9], rows=tie_b), Req("eos", [5, EOS, 8]), Req("bug", BASE)]
    return (
        write_trace(d / "a.h5", a, run=run),
        write_trace(d / "b.h5", b, run=run),
        write_trace(d / "ok.h5", ok_b, run=run),
    )


def test_diff_table_summary_and_exit_code(files):
    a, b, ok = files
    p = tk("diff", a, b)
    assert p.returncode == 1, p.stderr
    assert (
        "1/4 identical · 1 bf16_tie_flip · 1 post_eos · 0 cache_boundary · 1 unexplained · 0 incomparable" in p.stdout
    )
    assert "'sat'" in p.stdout and "'dog'" in p.stdout  # decoded with the run metadata's tokenizer
    assert p.stderr == ""
    p = tk("diff", a, ok)
    assert p.returncode == 0 and "2/4 identical" in p.stdout


def test_diff_json_is_one_document_with_the_schema(files):
    a, b, ok = files
    p = tk("diff", a, b, "--json")
    d = json.loads(p.stdout)
    assert d["schema"] == "tracekit.diff/2" and (d["a"], d["b"]) == (a, b)
    assert d["summary"] == {
        "pairs": 4,
        "identical": 1,
        "post_eos": 1,
        "bf16_tie_flip": 1,
        "cache_boundary": 0,
        "unexplained": 1,
        "incomparable": 0,
    }
    tie = next(x for x in d["pairs"] if x["key"] == "tie")
    for field in (
        "key",
        "class",
        "position",
        "token_a",
        "token_b",
        "gap_a",
        "gap_b",
        "gap_a_ulp",
        "gap_b_ulp",
        "boundary_a",
        "boundary_b",
        "drift_max",
        "drift_mean",
        "topk_overlap",
        "rule",
        "vllm_close",
    ):
        assert field in tie
    assert (tie["class"], tie["position"], tie["token_a"], tie["token_b"]) == ("bf16_tie_flip", 2, 7, 99)
    assert tie["gap_a"] == pytest.approx(0.05, abs=1e-6) and tie["vllm_close"] is True
    # Several B files: one document, one comparison each.
    d = json.loads(tk("diff", a, b, ok, "--json").stdout)
    assert [c["b"] for c in d["comparisons"]] == [b, ok] and d["a"] == a


def test_diff_markdown_and_only(files):
    a, b, _ = files
    p = tk("diff", a, b, "--markdown", "--only", "unexplained")
    assert p.stdout.startswith("**tracekit diff**: 1/4 identical")
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 and "bug" in rows[1] and "unexplained" in rows[1]
    assert p.returncode == 1


def test_diff_errors_and_usage(files, tmp_path):
    a, b, _ = files
    bad = tmp_path / "x.h5"
    bad.write_bytes(b"not hdf5")
    p = tk("diff", a, str(bad))
    assert p.returncode == 3 and p.stderr.startswith("Error: ") and "Traceback" not in p.stderr
    assert tk("diff", a).returncode == 2
    assert tk("diff", a, b, "--json", "--markdown").returncode == 2
    p = tk("diff", a, b, "--tie-nats", "1", "--drift-nats", "0.5")
    assert p.returncode == 3 and "--drift-nats" in p.stderr
    assert "Example" in tk("diff", "--help").stdout


def test_diff_does_not_import_torch(files):
    a, b, _ = files
    code = (
        "import sys\nfrom tracekit.cli import main\ntry:\n    main(['diff', %r, %r, '--json'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules, 'aiohttp' in sys.modules, "
        "'transformers' in sys.modules, file=sys.stderr)"
    ) % (a, b)
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )
    assert p.stderr.strip().splitlines()[-1] == "False False False"


def test_show_side_by_side(files):
    a, b, _ = files
    p = tk("show", a, b, "--key", "tie", "--context", "1")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "first difference: 2" in out and ">>  2" in out
    assert "7 'sat'" in out and "99 'dog'" in out
    assert "top-k of A at position 2" in out and "top-k of B at position 2" in out
    d = json.loads(tk("show", a, b, "--key", "tie", "--context", "1", "--json").stdout)
    assert [r["position"] for r in d["rows"]] == [1, 2, 3] and d["position"] == 2
    assert [c["id"] for c in d["a"]["topk_at_position"][:2]] == [7, 99]
    assert d["b"]["topk_at_position"][1]["logprob"] == pytest.approx(-0.75)
    p = tk("show", a, "--key", "nope")
    assert p.returncode == 3 and "no request with key 'nope'" in p.stderr
    p = tk("show", a, b, "--key", "tie", "--tokenizer", "/nonexistent")
    assert p.returncode == 3 and "tokenizer.json" in p.stderr


def test_show_first_divergent_finds_the_flip_itself(files):
    """Issue 24 item 16: the tour's example shows a flip, not whichever key comes first ("same"
    is A's first key and has none)."""
    a, b, _ = files
    d = json.loads(tk("show", a, b, "--first-divergent", "--context", "1", "--json").stdout)
    assert d["key"] == "tie" and d["first_difference"] == 2 and d["position"] == 2
    p = tk("show", a, a, "--first-divergent")
    assert p.returncode == 3 and "no key diverges" in p.stderr
    for args in ((a, "--first-divergent"), (a, b, "--key", "tie", "--first-divergent"), (a, b)):
        p = tk("show", *args)
        assert p.returncode == 2 and "--first-divergent" in p.stderr, (args, p.stderr)


def test_assert_equivalent(files):
    a, b, ok = files
    r = assert_equivalent(a, ok, allow={"bf16_tie_flip", "post_eos"})
    assert r.counts()["identical"] == 2
    with pytest.raises(AssertionError, match=r"(?s)1 pair\(s\).*bug: unexplained at 3"):
        assert_equivalent(a, b, allow={"bf16_tie_flip", "post_eos"})
    with pytest.raises(AssertionError, match="tie: bf16_tie_flip"):
        assert_equivalent(a, ok, allow={"post_eos"})
    with pytest.raises(ValueError, match="unknown classes"):
        assert_equivalent(a, ok, allow={"tie"})


def test_the_header_prints_the_mean_drift_rule_each_row_applies(files):
    """The header's mean-drift tolerance is the rule, m + (x - m) / n, not the bare m that no
    row applies (issue 24 item 17); evaluated at each row's n it gives that row's printed bound."""
    import re

    a, _, ok = files
    p = tk("diff", a, ok)
    head = next(x for x in p.stdout.splitlines() if x.startswith("thresholds ("))
    m = re.search(r"drift \S+ ulp / (\S+) nats, mean <= (\S+) \+ \((\S+) - (\S+)\) / n nats over n positions", head)
    assert m, head
    x, mean = float(m.group(1)), float(m.group(2))
    assert float(m.group(3)) == x and float(m.group(4)) == mean
    rows = re.findall(r"over (\d+) positions <= ([\d.e+-]+) / ([\d.e+-]+)", p.stdout)
    assert rows
    for n, row_x, row_mean in rows:
        assert float(row_x) == x
        assert float(row_mean) == pytest.approx(mean + (x - mean) / int(n), rel=1e-3)


def test_one_trace_and_a_replay_shows_the_b_select_form():
    """`diff serial.h5 --teacher-forced diag.h5` (one trace and a replay) is a usage error that
    gives the command that compares them, and that command runs (issue 24 item 17); the README's
    tour shows the same form."""
    from pathlib import Path

    demo = Path(ROOT) / "traces/demo"
    cell = next(p for p in sorted((demo / "cells").iterdir()) if (p / "teacher.h5").is_file())
    serial = demo / json.loads((cell / "cell.json").read_text())["baseline"]
    p = tk("diff", str(serial), "--teacher-forced", str(cell / "teacher.h5"))
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr
    form = f"tracekit diff {serial} {cell / 'teacher.h5'} --b-select history=full,dtype=fp32"
    assert form in p.stderr
    q = tk(*form.split()[1:], "--json")
    assert q.returncode in (0, 1), q.stderr
    assert json.loads(q.stdout)["summary"]["pairs"] >= 1
    tour = (Path(ROOT) / "README.md").read_text()
    assert "tracekit diff serial.h5 diag.h5 --b-select history=full,dtype=fp32" in tour
