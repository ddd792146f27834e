"""Usage errors exit 2 with one line, as the README promises (issue 24 item 15): a bad option
value, a /v1 URL, a URL without a scheme, a missing prompts file, the same trace twice. Each
is a real `tracekit` process; none needs a server (the checks come before any request)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures/prompts/cpu_small.jsonl"
TRACE = ROOT / "fixtures/format/v1/reference.h5"


def tk(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def capture(tmp_path, url="http://127.0.0.1:9", prompts=PROMPTS, *extra):
    return tk("capture", "--http", url, "--prompts", prompts, "--out", tmp_path / "o.h5", *extra)


def one_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stdout == "" and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
    return lines[0]


def test_concurrency_0_names_only_the_bad_option(tmp_path):
    line = one_line(capture(tmp_path, "http://127.0.0.1:9", PROMPTS, "--concurrency", "0"))
    assert "--concurrency 0: must be >= 1" in line
    for other in ("--repeat", "--max-tokens", "--timeout-s", "--top-logprobs"):
        assert other not in line, line
    assert not (tmp_path / "o.h5").exists()


def test_two_bad_options_are_both_named(tmp_path):
    line = one_line(capture(tmp_path, "http://127.0.0.1:9", PROMPTS, "--concurrency", "0", "--repeat", "0"))
    assert "--concurrency 0" in line and "--repeat 0" in line and "--timeout-s" not in line


@pytest.mark.parametrize(
    "url,says",
    [
        ("http://127.0.0.1:9/v1", "drop the trailing /v1"),
        ("127.0.0.1:9", "give the server's root URL"),
    ],
)
def test_bad_urls_exit_2(tmp_path, url, says):
    assert says in one_line(capture(tmp_path, url))


def test_missing_prompts_file_exits_2(tmp_path):
    line = one_line(capture(tmp_path, "http://127.0.0.1:9", tmp_path / "nope.jsonl"))
    assert f"{tmp_path / 'nope.jsonl'}: no such prompt file" in line


def test_diff_of_a_file_with_itself_exits_2():
    assert "A and B are the same file" in one_line(tk("diff", TRACE, TRACE))
