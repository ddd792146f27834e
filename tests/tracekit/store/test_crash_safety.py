"""A writer killed with SIGKILL at any moment must leave a readable trace holding
every request flushed before the kill (DESIGN: crash safety).

The reader runs in a subprocess with a timeout: an earlier design (SWMR reads
of the killed file) opened most killed files but hung forever on one whose
writer died mid-flush, and a hang must fail the test, not stall CI."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.writer_child import make_request

from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[3]
# (flushed requests to wait for, extra sleep in seconds): early, mid-append, late.
KILL_POINTS = [(0, 0.0), (0, 0.05), (0, 0.2)] + [
    (n, d) for n in (1, 2, 5, 17, 40, 90) for d in (0.0, 0.0003, 0.0007, 0.0015, 0.003)
]
VERIFY = """
import sys, numpy as np
from support.writer_child import make_request
from tracekit.store import TraceReader
with TraceReader(sys.argv[1]) as r:
    for i in range(len(r)):
        rec, toks, prompt = make_request(i)
        assert r.record(i).key == rec.key and r.record(i).error == rec.error, i
        got = r.tokens(i)
        assert np.array_equal(got.topk_id, toks.topk_id) and np.array_equal(got.topk_logit, toks.topk_logit), i
        assert np.array_equal(r.prompt_ids(i), prompt), i
    print(len(r))
"""


def _kill_at(path: Path, wait_for: int, delay_s: float) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    p = subprocess.Popen(
        [sys.executable, "-m", "support.writer_child", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    flushed = 0
    try:
        if wait_for == 0:
            time.sleep(0.25 + delay_s)  # may land during import, creation, or the first appends
        else:
            for line in p.stdout:
                if line.startswith("flushed"):
                    flushed = int(line.split()[1])
                    if flushed >= wait_for:
                        break
            time.sleep(delay_s)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # Lines printed before the kill are all durable; count them all.
    for line in p.stdout.read().splitlines():
        if line.startswith("flushed"):
            flushed = int(line.split()[1])
    return flushed


@pytest.mark.slow
@pytest.mark.parametrize("wait_for,delay_s", KILL_POINTS)
def test_sigkill_leaves_readable_file(tmp_path, wait_for, delay_s):
    path = tmp_path / "killed.h5"
    flushed = _kill_at(path, wait_for, delay_s)
    if not path.exists():
        # Killed before the file was renamed into place: nothing was flushed yet.
        assert flushed == 0
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = subprocess.run(
        [sys.executable, "-c", VERIFY, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    n = int(out.stdout)
    assert n >= flushed, f"lost flushed requests: file holds {n}, child flushed {flushed}"
    assert n <= flushed + 1
    # Recovery replaced the killed file by a clean one and removed the journal.
    assert not Path(str(path) + ".journal").exists()
    with TraceReader(path) as r:
        assert len(r) == n


def test_live_reader_follows_a_running_writer(tmp_path):
    """While a capture runs, `tracekit inspect` must see its rows (SWMR), and must
    not mistake the live file for a killed one and rebuild it under the writer."""
    path = tmp_path / "live.h5"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    p = subprocess.Popen(
        [sys.executable, "-m", "support.writer_child", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in p.stdout:
            if line.startswith("flushed") and int(line.split()[1]) >= 5:
                break
        with TraceReader(path) as r:
            assert len(r) >= 5
        assert Path(str(path) + ".journal").exists()  # still the writer's
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_clean_close_leaves_no_journal(tmp_path):
    from tracekit.schema import Layout, RunMeta
    from tracekit.store import TraceWriter

    with TraceWriter(tmp_path / "t.h5", RunMeta(source="http", run={}, layout=Layout(topk=8, raw_logits=True))) as w:
        w.append(*make_request(0))
        assert (tmp_path / "t.h5.journal").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.h5"]


def test_killed_file_without_journal_is_a_clear_error(tmp_path):
    path = tmp_path / "k.h5"
    _kill_at(path, 3, 0.0)
    Path(str(path) + ".journal").unlink()
    r = subprocess.run(
        [sys.executable, "-m", "tracekit", "inspect", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 3 and "journal" in r.stderr and "h5clear" in r.stderr


def test_kill_points_cover_twenty():
    """The issue asks for at least 20 distinct kill points."""
    assert len(set(KILL_POINTS)) >= 20


def test_a_reused_pid_does_not_make_a_killed_file_live(tmp_path):
    """The killed writer's pid may belong to another process by the time a reader comes
    (pids wrap). Its journal lock, which the kernel dropped at the kill, decides: the file
    is recovered, never opened as a live SWMR file (which can hang on a killed one)."""
    from tracekit.store import journal

    path = tmp_path / "k.h5"
    flushed = _kill_at(path, 4, 0.0)
    jp = journal.journal_path(path)
    data = jp.read_bytes()
    _, n, _ = journal._HEAD.unpack_from(data, 0)
    meta, _ = journal._decode(data[journal._HEAD.size : journal._HEAD.size + n])
    meta["pid"] = os.getpid()  # alive: this test process
    meta.pop("arrays")
    jp.write_bytes(journal._encode(meta) + data[journal._HEAD.size + n :])
    assert journal.read_journal(jp)[0]["pid"] == os.getpid()
    with TraceReader(path) as r:
        assert not r.live and len(r) >= flushed
    assert not jp.exists()
