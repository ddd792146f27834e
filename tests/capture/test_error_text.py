"""An engine's long error text is shortened at a word, never inside one, and says it was
shortened (issue 24 item 17): in the trace's error column and in `capture`'s `failed:` line.
Real sockets (the replay server), a real HDF5 trace."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.capture_helpers import write_prompts
from support.replay import ReplayServer, routes_for

from tracekit.store import TraceReader
from tracekit.text import clip

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = " ".join(f"word{i:03d}" for i in range(90))  # what the replay server's `longerror` sends


def _whole_words(shown: str, limit: int) -> None:
    m = re.fullmatch(r"(.*)… \((\d+) chars\)", shown)
    assert m, shown
    head = m.group(1)
    assert int(m.group(2)) == len(MESSAGE) and len(head) < limit
    assert MESSAGE.startswith(head) and MESSAGE[len(head)] == " "  # it ends where a word ends
    assert head.split()[-1] == f"word{len(head.split()) - 1:03d}"


def test_clip():
    assert clip("short text", 20) == "short text" and clip("two\nlines", 20) == "two lines"
    _whole_words(clip(MESSAGE, 200), 200)
    assert clip("x" * 50, 20) == "x" * 8 + "… (50 chars)"  # one long word: cut, and said
    assert all(len(clip(MESSAGE, n)) <= n for n in (20, 120, 200, 500))


def test_a_long_engine_error_is_cut_at_a_word(tmp_path):
    pfile = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "e", "prompt": "FAULT:longerror"}])
    with ReplayServer(routes_for("vllm")) as srv:
        r = subprocess.run(
            [sys.executable, "-m", "tracekit", "capture", "--http", srv.url, "--prompts", pfile]
            + ["--out", str(tmp_path / "r.h5"), "--max-tokens", "12", "--top-logprobs", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    assert r.returncode == 1, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("failed: e (error): "))
    with TraceReader(tmp_path / "r.h5") as t:
        i = list(t.requests.key).index("e")
        stored = t.record(i).error
    assert "word000" in stored and "…" in stored
    _whole_words(stored[stored.index("word000") :], 500)
    _whole_words(
        line.removeprefix("failed: e (error): ")[line.removeprefix("failed: e (error): ").index("word000") :], 200
    )


def test_clipping_twice_keeps_the_length_of_the_original():
    twice = clip(clip(MESSAGE, 500), 200)
    _whole_words(twice, 200)
    assert twice == clip(MESSAGE, 200)
