"""The CLI's top-level error contract (cli/__init__.py: main).

Exit 1 means "divergence found": a CI job reads it as a verdict. So no crash may
exit 1: an unexpected exception exits 3 with one `Error:` line that says it is
an internal error and how to get the traceback; usage errors exit 2 in one
line; Ctrl-C exits 130. stdout stays empty on every error path.

The failing commands are real click commands registered on the real `cli`
group in a child process (no patching of the handler under test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.capture_helpers import sigint_default

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, threading, click
from tracekit.cli import cli, main

@cli.command("boom")
def boom():
    raise ValueError("bad value in the writer\\nsecond line")

@cli.command("keyerror")
def keyerror():
    {}["x"]

@cli.command("fileerror")
def fileerror():
    raise click.FileError("f.txt", hint="unreadable")

@cli.command("interrupt")
def interrupt():
    raise KeyboardInterrupt

@cli.command("wait")
def wait():
    print("ready", file=sys.stderr, flush=True)
    threading.Event().wait()

main(sys.argv[1:])
"""


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "TRACEKIT_DEBUG"}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=ROOT, env=e, timeout=120
    )


def one_error_line(r: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.mark.parametrize("cmd,what", [("boom", "ValueError: bad value in the writer"), ("keyerror", "KeyError")])
def test_unexpected_exception_exits_3_not_1(cmd, what):
    """A crash must never read as a verdict (exit 1)."""
    line = one_error_line(run(cmd), 3, "internal error", what, "--debug", "TRACEKIT_DEBUG=1")
    assert "second line" not in line


@pytest.mark.parametrize("how", [["--debug", "boom"], ["boom"]])
def test_debug_shows_the_traceback(how):
    r = run(*how, env={"TRACEKIT_DEBUG": "1"} if how == ["boom"] else None)
    assert r.returncode == 3 and r.stdout == ""
    assert "Traceback (most recent call last)" in r.stderr and ", in boom" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: internal error")


def test_debug_env_zero_is_off():
    one_error_line(run("boom", env={"TRACEKIT_DEBUG": "0"}), 3, "internal error")


def test_click_file_error_is_a_tool_error():
    """click's own default for a FileError is exit 1, which would read as a divergence."""
    one_error_line(run("fileerror"), 3, "f.txt")


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["nope"], "No such command 'nope'"),
        (["boom", "--nope"], "No such option '--nope'"),
        (["--nope"], "No such option '--nope'"),
    ],
)
def test_usage_errors_exit_2_in_one_line(args, fragment):
    one_error_line(run(*args), 2, fragment, "--help")


def test_keyboard_interrupt_exits_130():
    r = run("interrupt")
    assert r.returncode == 130 and r.stdout == "" and "Traceback" not in r.stderr


def test_sigint_exits_130():
    """A real Ctrl-C (SIGINT) while a command runs."""
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, "wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=sigint_default,
    )
    try:
        assert p.stderr.readline().strip() == "ready"  # the command is running: wait on it, not on a clock
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and out == "" and "Traceback" not in err, err
