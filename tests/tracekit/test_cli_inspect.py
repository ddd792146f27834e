"""`tracekit inspect` and the CLI's error contract: one line on stderr, exit 3,
nothing on stdout; usage errors exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "fixtures/format/v1/reference.h5"


def tk(*args):
    return subprocess.run([sys.executable, "-m", "tracekit", *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_version():
    r = tk("--version")
    assert r.returncode == 0 and "tracekit, version" in r.stdout


def test_inspect_json_reference():
    r = tk("inspect", REF, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["format_version"] == 1 and s["requests"] == 3 and s["token_rows"] == 6
    assert s["by_status"] == {"ok": 1, "error": 1, "cancelled": 1, "timeout": 0}
    assert s["topk"] == 5 and s["raw_logits"] and s["full_logits"] and s["run"]["model"] == "reference"


def test_inspect_text():
    r = tk("inspect", REF)
    assert r.returncode == 0 and "requests: 3 (ok 1, error 1, cancelled 1, timeout 0)" in r.stdout


def _one_error_line(r, fragment):
    assert r.returncode == 3
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_newer_version(tmp_path):
    p = tmp_path / "new.h5"
    p.write_bytes(REF.read_bytes())
    with h5py.File(p, "r+") as f:
        f.attrs["format_version"] = 99
    _one_error_line(tk("inspect", p), "version 99 is newer")


def test_random_bytes(tmp_path):
    p = tmp_path / "junk.h5"
    p.write_bytes(bytes(range(256)) * 40)
    _one_error_line(tk("inspect", p), "not a readable HDF5 file")


def test_non_trace_hdf5(tmp_path):
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["data"] = [1.0]
    _one_error_line(tk("inspect", p), "not a tracekit trace")


def test_truncated_trace(tmp_path):
    p = tmp_path / "cut.h5"
    p.write_bytes(REF.read_bytes()[:5000])
    _one_error_line(tk("inspect", p), str(p))


def test_usage_error_exits_2():
    r = tk("inspect", "--no-such-option")
    assert r.returncode == 2 and r.stdout == ""
