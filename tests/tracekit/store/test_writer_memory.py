"""The trace writer's memory stays flat as rows are appended (found by bench/capture_soak.py).

HDF5 keeps a raw-data chunk cache of 1 MiB per dataset by default, and a written chunk stayed in
it while it fitted: a capture's resident memory grew with every row (~1.04 KB a 12-token request,
+53 MB over 48,000), although an append-only writer never reads a chunk back. The writer now
opens its datasets with no chunk cache, or one chunk for filtered ones (compressed or checksummed:
every dataset since the Fletcher-32 checksums), a fixed size whatever the rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceReader, TraceWriter

ROOT = Path(__file__).resolve().parents[3]

GROW = r"""
import sys
import numpy as np
from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceWriter

def rss_kb():
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")).split()[1])

meta = RunMeta(source="http", run={}, layout=Layout(topk=5))
w = TraceWriter(sys.argv[1], meta, expected_tokens=72000, journal=False)
tok = TokenColumns(np.arange(12), np.full(12, -1.0), np.arange(12) * 0.01, np.tile(np.arange(5), (12, 1)),
                   np.tile(-np.arange(5.0), (12, 1)))
for i in range(6000):
    if i == 1000:
        before = rss_kb()
    rec = RequestRecord(key=f"r{i:05d}", prompt_hash=prompt_hash("p"), status="ok", prompt_len=10, params="{}")
    w.append_many([(rec, tok, list(range(10)))])
print((rss_kb() - before) / 5000)
w.close()
"""


def test_resident_memory_does_not_grow_with_the_rows(tmp_path):
    """5,000 appended 12-token requests (in a fresh process: nothing else allocates there): the
    writer's own growth is the key set and HDF5's chunk index, ~0.33 KB a request; with the
    default chunk cache it was 1.04 KB (every written chunk kept)."""
    p = subprocess.run(
        [sys.executable, "-c", GROW, str(tmp_path / "g.h5")],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    kb_per_request = float(p.stdout)
    assert kb_per_request < 0.6, kb_per_request


def test_datasets_are_opened_without_a_chunk_cache_and_read_back_whole(tmp_path):
    """Plain datasets: no chunk cache (appends go straight to the file); the compressed full-vocab
    logits: one chunk (the chunk being filled is not decompressed at every append). Everything
    appended reads back bitwise."""
    out = tmp_path / "c.h5"
    w = TraceWriter(out, RunMeta(source="teacher_forced", run={}, layout=Layout(topk=3, vocab_size=50)))
    rng = np.random.default_rng(0)
    sent = []
    for i in range(40):  # 40 appends of 7 rows: chunks of the logits column filled over several appends
        lg = rng.standard_normal((7, 50)).astype(np.float32)
        tok = TokenColumns(np.arange(7), rng.standard_normal(7), np.arange(7.0), np.tile(np.arange(3), (7, 1)),
                           rng.standard_normal((7, 3)), logits=lg)  # fmt: skip
        w.append_many([(RequestRecord(key=f"k{i}", prompt_hash=prompt_hash("p"), status="ok"), tok, None)])
        sent.append(tok)
    for name, ds in w._handles().items():
        nslots, nbytes, w0 = ds.id.get_access_plist().get_chunk_cache()
        # every dataset is checksummed (Fletcher-32, issue 24): one chunk each, like the compressed
        # logits, so the chunk being filled is not read back and checked at every append
        assert ds.fletcher32, name
        want = int(np.prod(ds.chunks)) * ds.dtype.itemsize
        assert (nbytes, w0) == (want, 1.0), name
    w2 = TraceWriter(tmp_path / "plain.h5", RunMeta(source="http", run={}, layout=Layout(topk=3)), checksums=False)
    for name, ds in w2._handles().items():  # without checksums (an older file's layout): no cache
        assert ds.id.get_access_plist().get_chunk_cache()[1:] == (0, 1.0), name
    w2.close()
    w.close()
    with TraceReader(out) as r:
        assert len(r) == 40
        for i, tok in enumerate(sent):
            got = r.tokens(i, full_logits=True)
            for name in ("token_id", "logprob", "topk_id", "topk_logprob", "logits"):
                a, b = getattr(got, name), getattr(tok, name)
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (i, name)
    assert h5py.is_hdf5(out)
