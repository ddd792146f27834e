"""The reader on damaged files: a clear TraceFormatError or a whole trace, nothing else.

633 damaged copies (fixed seeds) of the v1 reference file and of a real
capture (fixtures/format/v1/capture.h5, made by fixtures/format/make_capture.py
against the reference engine): 100 byte-level ones of each (truncated,
bit-flipped anywhere and in HDF5 metadata, zeroed and garbage blocks) and every
structural edit (deleted datasets, groups and attributes, datasets replaced by
groups, wrong dtypes, ranks and widths, columns one row short or long, offsets
and counts out of range, enumerations and strings broken). Each is read as the
commands read it, in a worker subprocess with a timeout, so that a hang or a
crash of the HDF5 library fails the test instead of stalling CI.

Before this reader (the one of commit ab33a80), the same 633 gave 141
tracebacks (25 of them from byte-level damage, most an h5py "incorrect metadata
checksum") and 63 silently shorter traces.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from support import fuzz_reader as fz

ROOT = Path(__file__).resolve().parents[3]
SOURCES = {
    "ref": (ROOT / "fixtures/format/v1/reference.h5", 1),
    "cap": (ROOT / "fixtures/format/v1/capture.h5", 2),
}
N_BYTES = 100  # byte-level variants per source file
N_VARIANTS = 633  # the full count: 2 x 100 byte-level + every structural edit of both files


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    names, paths, tags = [], [], []
    for tag, (src, seed) in SOURCES.items():
        for name, p in fz.variants(src, d, seed, N_BYTES, tag):
            names.append(name)
            paths.append(p)
            tags.append(tag)
    baseline = dict(zip(SOURCES, fz.read_all([src for src, _ in SOURCES.values()])))
    results = fz.read_all(paths)
    outcomes = [fz.classify([r], baseline[t])[0] for r, t in zip(results, tags)]
    counts = collections.Counter(outcomes)
    print(f"\nreader fuzz: {len(paths)} variants: {dict(counts)}")
    return names, paths, results, outcomes


def test_the_full_count_is_fuzzed(fuzzed):
    names, *_ = fuzzed
    assert len(names) == N_VARIANTS >= 200
    kinds = collections.Counter(n.split(":")[1].rstrip("0123456789@x").split("@")[0] for n in names)
    for kind in ("truncate", "flip", "flip-meta", "zero", "garbage", "delete", "retype", "value", "attr"):
        assert any(k.startswith(kind) for k in kinds), kind


def test_every_variant_is_a_clear_error_or_reads_whole(fuzzed):
    """Never a traceback, a hang, a dead worker, or a trace shorter than the original."""
    names, _, results, outcomes = fuzzed
    bad = [(n, o, r.get("message", "")) for n, r, o in zip(names, results, outcomes) if o not in fz.ALLOWED]
    assert not bad, "\n".join(f"{o}: {n}: {m[:200]}" for n, o, m in bad)


def test_errors_are_one_line_and_name_the_file(fuzzed):
    names, paths, results, outcomes = fuzzed
    for n, p, r, o in zip(names, paths, results, outcomes):
        if o == "error":
            msg = r["message"]
            assert "\n" not in msg and msg.startswith(str(p)), (n, msg)


def test_structural_edits_never_read_as_the_original(fuzzed):
    """An edit that changes what the file holds (not a no-op) must show: an error, or the changed values."""
    names, _, _, outcomes = fuzzed
    same = [n for n, o in zip(names, outcomes) if o == "same" and ":delete" in n]
    assert not same, same


def _damaged_samples(fuzzed) -> list[Path]:
    """One errored variant of each kind, for the CLI."""
    names, paths, _, outcomes = fuzzed
    seen, out = set(), []
    for n, p, o in zip(names, paths, outcomes):
        kind = n.split(":")[1].rstrip("0123456789@x")[:6]
        if o == "error" and kind not in seen:
            seen.add(kind)
            out.append(p)
    return out


def tk(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cli_on_damaged_files_exits_3_in_one_line(fuzzed):
    """`tracekit inspect` and `tracekit diff` on damaged files: exit 3, one `Error:` line, empty stdout."""
    samples = _damaged_samples(fuzzed)
    assert len(samples) >= 8
    good = SOURCES["cap"][0]
    for p in samples:
        for args in (("inspect", p), ("diff", good, p)):
            r = tk(*args)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 3 and r.stdout == "", (args, r.returncode, r.stdout, r.stderr)
            assert len(lines) == 1 and lines[0].startswith("Error: ") and str(p) in lines[0], (args, r.stderr)


def test_prompt_len_without_prompt_ids_is_an_error_not_a_shorter_trace(tmp_path):
    """Issue 15: a row claiming prompt ids that were never written made the reader drop it and every
    later row (inspect said 1 request, exit 0). Such a file (written by the old writer) is an error."""
    p = tmp_path / "t.h5"
    p.write_bytes(SOURCES["ref"][0].read_bytes())
    with h5py.File(p, "r+") as f:
        f["requests/prompt_len"][0] = 7  # row 0 holds 3 prompt ids
    r = tk("inspect", p)
    assert r.returncode == 3 and r.stdout == "" and "prompt" in r.stderr, r.stderr


def test_a_column_cut_short_is_an_error(tmp_path):
    """A trace with fewer token rows than its requests claim is damage, not a reason to drop requests."""
    p = tmp_path / "t.h5"
    p.write_bytes(SOURCES["cap"][0].read_bytes())
    with h5py.File(p, "r+") as f:
        for name in f["tokens"]:
            f["tokens"][name].resize(200, axis=0)
    r = tk("inspect", p, "--json")
    assert r.returncode == 3 and r.stdout == "" and "token" in r.stderr, r.stderr
