"""Run metadata shared by every writer of traces: tool version, git commit, host.

Everything here goes into a trace's `run` attribute, so it must never hold a
secret: `RunMeta` redacts secret-looking keys again on the way in.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__
from .runrecord import RUN_VERSION, VERSION_KEY

REPO_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=8)
def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checkout's commit (with '-dirty' when it has changes), or None outside git.

    Asked once per process and root (two git subprocesses, ~24 ms, were a fixed cost of every
    capture): the answer describes the code this process imported, which later edits to the
    checkout do not change."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def host_info() -> dict:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (secrets are passed by env-var name, never on the command line)."""
    return shlex.join(["tracekit"] + list((argv if argv is not None else sys.argv)[1:]))


def base_run(**fields) -> dict:
    """The common part of every trace's `run` JSON; callers add their own fields."""
    return {
        VERSION_KEY: RUN_VERSION,
        "tool": f"tracekit {__version__}",
        "git_commit": git_commit(),
        "host": host_info(),
        "command": command_line(),
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        **fields,
    }
