"""Security (issue 15): a whole `tracekit run` directory — traces, engine logs, checks,
diffs, the manifest, the report — never holds the API key or an auth header, although
the engine demands the key (`--api-key-env`) and every capture and check sends it.

The run passing its checks is what proves the key was sent: the engine answers 401 to
any /v1 request without it, so no capture, probe or lifecycle check could pass."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def test_no_key_or_auth_header_anywhere_in_a_run_directory(tmp_path):
    key = "tk-" + secrets.token_hex(16)
    matrix = tmp_path / "m.toml"
    matrix.write_text(
        f'[[prompts]]\nname = "p"\npath = "{ROOT}/fixtures/prompts/cpu_small.jsonl"\n'
        "[run]\nready_timeout_s = 120\ntimeout_s = 120\n"
        "[checks]\ncancel_after_tokens = 2\n"
        "[axes]\nconcurrency = [4]\noutput_tokens = [8]\n"
        '[[target]]\nname = "ref"\nserve = ["--threads", "1", "--slots", "4"]\napi_key_env = "TK_TEST_API_KEY"\n'
    )
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "run", str(matrix), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), TK_TEST_API_KEY=key),
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (cell,) = json.loads(p.stdout)["cells"]
    assert cell["verdict"] == "pass" and cell["equality"] == "8/8"
    assert all(v == "pass" for v in cell["checks"].values()), cell["checks"]  # every request carried the key
    man = json.loads((out / "manifest.json").read_text())
    (eng,) = man["engines"].values()
    assert eng["command"][-2:] == ["--api-key-env", "TK_TEST_API_KEY"]  # the variable's name only
    assert eng["self_report"]["status"] == 200  # /v1/models, behind the key

    files = [f for f in out.rglob("*") if f.is_file()]
    kinds = {f.suffix for f in files}
    assert {".h5", ".log", ".json", ".md", ".png", ".toml"} <= kinds, kinds
    for f in files:
        data = f.read_bytes().lower()
        for needle in (key.encode(), b"bearer", b"authorization"):
            assert needle.lower() not in data, f"{f.relative_to(out)} holds {needle!r}"
    # The traces' strings decoded (run metadata, errors, params), not only their raw bytes.
    for f in out.rglob("*.h5"):
        with TraceReader(f) as r:
            text = json.dumps(r.meta.run) + "".join(r.requests.error) + "".join(r.requests.params)
        assert key not in text and "bearer" not in text.lower(), f
    assert key not in p.stdout + p.stderr
