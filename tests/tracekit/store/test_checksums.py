"""Silent corruption (issue 24 item 3): bytes changed inside a dataset's data are found.

Every dataset of a trace carries HDF5's Fletcher-32 filter; a chunk whose bytes changed after
they were written fails its checksum when it is read, and every reader (TraceReader's columns,
rows and prompt ids, its whole-file verify, `tracekit inspect`) fails with one line naming the
damaged dataset. Before, `inspect` passed a file with 3,000 random bytes written into its data
and `diff` then blamed the engine for logprobs of 6.65e+37. A file written without checksums
(an older tracekit: the `checksum` attribute absent) reads as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tracekit.errors import TraceFormatError
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceReader, TraceWriter

ROOT = Path(__file__).resolve().parents[3]
N_REQ, N_TOK, K = 40, 100, 20


def _write(path: Path, checksums: bool = True) -> None:
    rng = np.random.default_rng(0)
    meta = RunMeta(source="http", run={}, layout=Layout(topk=K))
    with TraceWriter(path, meta, expected_tokens=N_REQ * N_TOK, checksums=checksums) as w:
        for i in range(N_REQ):
            tok = TokenColumns(
                rng.integers(0, 1000, N_TOK).astype(np.int32),
                -rng.random(N_TOK).astype(np.float32),
                np.arange(N_TOK) * 0.01,
                rng.integers(0, 1000, (N_TOK, K)).astype(np.int32),
                -np.sort(rng.random((N_TOK, K)).astype(np.float32), axis=1)[:, ::-1],
            )
            rec = RequestRecord(key=f"r{i}", prompt_hash=prompt_hash("p"), status="ok", prompt_len=3)
            w.append(rec, tok, [1, 2, 3])


def _corrupt(path: Path, dataset: str, n_bytes: int) -> None:
    """Random bytes written over the middle of the dataset's first chunk (its data, not metadata)."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    assert info.size > n_bytes
    at = info.byte_offset + (info.size - n_bytes) // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        old = fh.read(n_bytes)
        fh.seek(at)
        new = os.urandom(n_bytes)
        assert new != old
        fh.write(new)


def _inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", "inspect", str(path)], capture_output=True, text=True, cwd=ROOT
    )


def test_every_dataset_carries_a_checksum_and_a_clean_trace_reads_back(tmp_path):
    p = tmp_path / "t.h5"
    _write(p)
    with h5py.File(p, "r") as f:
        assert f.attrs["checksum"] == "fletcher32"
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) >= 25 and all(f[n].fletcher32 for n in names), [n for n in names if not f[n].fletcher32]
    with TraceReader(p) as r:
        assert r.meta.checksum == "fletcher32" and len(r) == N_REQ
        assert r.verify() > N_REQ * N_TOK * K * 8
    r = _inspect(p)
    assert r.returncode == 0 and "checksums: Fletcher-32 on every dataset" in r.stdout, r.stderr


@pytest.mark.parametrize("dataset", ["tokens/topk_logprob", "tokens/token_id"])
def test_changed_bytes_in_token_data_fail_every_reader_naming_the_dataset(tmp_path, dataset):
    p = tmp_path / "t.h5"
    _write(p)
    _corrupt(p, dataset, 3000 if dataset.endswith("logprob") else 300)
    name = dataset.split("/")[1]
    with TraceReader(p) as r:  # the structure is whole: the open passes, reading the data does not
        for read in (lambda: r.column(name), lambda: r.tokens(0), r.verify):
            with pytest.raises(TraceFormatError) as e:
                read()
            msg = str(e.value)
            assert f"/{dataset}" in msg and "Fletcher-32 checksum" in msg and "\n" not in msg, msg
    r = _inspect(p)
    assert r.returncode == 3 and r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and f"/{dataset}" in lines[0], r.stderr
    assert "Fletcher-32" in lines[0] and "Traceback" not in r.stderr


def test_changed_bytes_in_the_request_table_fail_at_open_naming_the_dataset(tmp_path):
    p = tmp_path / "t.h5"
    _write(p)
    _corrupt(p, "requests/t_done_s", 64)
    with pytest.raises(TraceFormatError, match=r"/requests/t_done_s: damaged data: a chunk failed its Fletcher-32"):
        TraceReader(p)
    r = _inspect(p)
    assert r.returncode == 3 and "/requests/t_done_s" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_without_checksums_the_same_damage_goes_unseen(tmp_path):
    """The yardstick: a file written as before (no filter) hands the damaged bytes out."""
    p, q = tmp_path / "plain.h5", tmp_path / "clean.h5"
    _write(p, checksums=False)
    _write(q, checksums=False)
    _corrupt(p, "tokens/topk_logprob", 3000)
    with TraceReader(p) as r, TraceReader(q) as c:
        assert r.meta.checksum == "" and not r.has_column("logits")
        assert r.verify() == c.verify()  # no error: the damage is invisible without checksums
        assert not np.array_equal(r.column("topk_logprob"), c.column("topk_logprob"))
    res = _inspect(p)
    assert res.returncode == 0 and "checksums: none" in res.stdout


def test_older_files_still_read(tmp_path):
    """The v1 reference files predate checksums: they read as before, with no checksum."""
    for ref in ("fixtures/format/v1/reference.h5", "fixtures/format/v1/capture.h5"):
        with TraceReader(ROOT / ref) as r:
            assert r.meta.checksum == "" and len(r) > 0
            r.verify()


def test_a_dataset_stripped_of_its_checksum_is_refused(tmp_path):
    """A file that says it is checksummed but holds a dataset without the filter (rewritten by
    another tool) is damage, not silently unchecked."""
    p = tmp_path / "t.h5"
    _write(p)
    with h5py.File(p, "r+") as f:
        data = f["tokens/logprob"][()]
        del f["tokens/logprob"]
        f.create_dataset("tokens/logprob", data=data, maxshape=(None,), chunks=True)
    with pytest.raises(TraceFormatError, match=r"/tokens/logprob: no Fletcher-32 checksum filter"):
        TraceReader(p)


def test_a_repacked_small_trace_keeps_its_checksums(tmp_path):
    """Small traces are rewritten at close with fitted chunks (writer.repack_if_sparse)."""
    p = tmp_path / "small.h5"
    meta = RunMeta(source="http", run={}, layout=Layout(topk=K))
    with TraceWriter(p, meta) as w:  # no size hint: full-size chunks, so the close repacks
        tok = TokenColumns(np.arange(4), np.zeros(4), np.arange(4.0), np.zeros((4, K), int), np.zeros((4, K)))
        w.append(RequestRecord(key="a", prompt_hash=prompt_hash("p"), status="ok"), tok)
    assert os.path.getsize(p) < 200_000
    with h5py.File(p, "r") as f:
        assert f["tokens/topk_id"].fletcher32 and f["tokens/topk_id"].chunks[0] <= 4
    _corrupt(p, "tokens/topk_id", 100)
    with TraceReader(p) as r, pytest.raises(TraceFormatError, match="/tokens/topk_id: damaged data"):
        r.column("topk_id")
