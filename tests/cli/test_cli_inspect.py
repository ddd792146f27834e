"""`tracekit inspect` and the CLI's error contract: one line on stderr, exit 3,
nothing on stdout; usage errors exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

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


def test_usage_error_exits_2_in_one_line():
    r = tk("inspect", "--no-such-option")
    assert r.returncode == 2 and r.stdout == ""
    want = "Error: No such option '--no-such-option'. (see 'tracekit inspect --help')"
    assert r.stderr.strip().splitlines() == [want]


@pytest.mark.parametrize("as_json", [False, True])
def test_missing_file(tmp_path, as_json):
    p = tmp_path / "nope.h5"
    _one_error_line(tk("inspect", p, *(["--json"] if as_json else [])), f"{p}: no such file")


def test_missing_file_with_a_non_utf8_name(tmp_path):
    """A path that is not UTF-8 (bytes 0xff) is still one line, not a UnicodeEncodeError."""
    p = os.path.join(os.fsencode(tmp_path), b"nope\xff.h5")
    r = subprocess.run([sys.executable, "-m", "tracekit", "inspect", p], capture_output=True, cwd=ROOT)
    assert r.returncode == 3 and r.stdout == b"" and b"Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(b"Error: ") and b"no such file" in lines[0], r.stderr


def test_trace_with_a_non_utf8_name_reads(tmp_path):
    p = os.path.join(os.fsencode(tmp_path), b"ref\xff.h5")
    with open(p, "wb") as f:
        f.write(REF.read_bytes())
    r = subprocess.run([sys.executable, "-m", "tracekit", "inspect", p, "--json"], capture_output=True, cwd=ROOT)
    assert r.returncode == 0 and json.loads(r.stdout)["requests"] == 3, r.stderr


@pytest.mark.parametrize(
    "content", [b"", "caf\u00e9 \u2014 a text file\n".encode("latin-1", "replace"), b"\xff\xfe\x00junk" * 100]
)
def test_not_hdf5_text_empty_or_not_utf8(tmp_path, content):
    p = tmp_path / "x.h5"
    p.write_bytes(content)
    _one_error_line(tk("inspect", p), "not a readable HDF5 file")


def test_directory_is_a_usage_error(tmp_path):
    r = tk("inspect", tmp_path)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "is a directory" in r.stderr and "Traceback" not in r.stderr


def test_damaged_chunk_is_found_by_inspect_not_by_quick(tmp_path):
    """The checks at open see metadata; a damaged data chunk shows only when read. `inspect`
    reads every row (exit 3, naming the column); `--quick` checks the structure only."""
    from support.fuzz_reader import raw_ranges

    p = tmp_path / "chunk.h5"
    data = bytearray(REF.read_bytes())
    with h5py.File(REF, "r") as f:
        info = f["tokens/logits"].id.get_chunk_info(0)  # gzip-compressed: zeros do not inflate
    assert (info.byte_offset, info.byte_offset + info.size) in raw_ranges(REF)
    data[info.byte_offset : info.byte_offset + info.size] = bytes(info.size)
    p.write_bytes(bytes(data))
    _one_error_line(tk("inspect", p), "/tokens/logits")
    r = tk("inspect", p, "--quick")
    assert r.returncode == 0 and "checked: structure only (--quick)" in r.stdout


def test_bare_tracekit_prints_help_on_stderr():
    r = tk()
    assert r.returncode == 2 and r.stdout == "" and "Commands:" in r.stderr and "Traceback" not in r.stderr
