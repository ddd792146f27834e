"""Corrupt copies of a trace, and read each one the way every tracekit command does.

Used by tests/tracekit/store/test_reader_fuzz.py. Two halves:

- `variants(src, rng, n_bytes)`: byte-level damage (truncation, bit flips biased
  towards HDF5 metadata, zeroed and garbage blocks) and structural edits made
  with h5py (deleted datasets, groups and attributes, wrong dtypes and shapes,
  offsets out of range, enumerations and strings broken), from a fixed seed.
- `read_all(paths)`: reads every file in a worker subprocess (this file run as a
  script) and returns one outcome each. A read that takes longer than its
  timeout is a `hang`, a worker that dies (a crash in the HDF5 C library) is
  `died`: the worker is restarted for the rest, so one bad file costs one file.

Outcomes: `error` (a TraceFormatError, the only allowed failure), `same`
(reads, and holds exactly what the original holds), `values` (reads, same
requests and rows, some values differ: raw data has no checksum in HDF5),
`crash` (any other exception: a bug), `hang`, `died`, and `shorter` (reads, but
with fewer requests or token rows than the original: a silent loss).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ALLOWED = ("error", "same", "values")


# ---- byte-level damage --------------------------------------------------------------


def raw_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of raw chunk data (everything else is HDF5 metadata or free space)."""
    out = []
    with h5py.File(path, "r") as f:

        def visit(_, obj):
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                for i in range(obj.id.get_num_chunks()):
                    info = obj.id.get_chunk_info(i)
                    out.append((info.byte_offset, info.byte_offset + info.size))

        f.visititems(visit)
    return sorted(out)


def _metadata_offset(rng: np.random.Generator, size: int, raw: list[tuple[int, int]]) -> int:
    for _ in range(100):
        pos = int(rng.integers(0, size))
        if not any(s <= pos < e for s, e in raw):
            return pos
    return int(rng.integers(0, size))


def byte_variants(data: bytes, raw: list[tuple[int, int]], rng: np.random.Generator, n: int) -> list[tuple]:
    """n (name, bytes) copies of `data`, each damaged one way."""
    size, out = len(data), []
    for i in range(n):
        kind = ("truncate", "flip", "flip-meta", "zero", "garbage")[i % 5]
        b = bytearray(data)
        if kind == "truncate":
            cut = int(rng.integers(0, size))
            b = b[:cut]
            name = f"truncate@{cut}"
        elif kind.startswith("flip"):
            k = int(rng.integers(1, 9))
            meta = kind == "flip-meta"
            pos = [_metadata_offset(rng, size, raw) if meta else int(rng.integers(0, size)) for _ in range(k)]
            for p in pos:
                b[p] ^= 1 << int(rng.integers(0, 8))
            name = f"{kind}x{k}@{pos[0]}"
        else:
            block = int(rng.choice([16, 64, 512, 4096]))
            start = int(rng.integers(0, max(1, size - block)))
            start -= start % 16
            b[start : start + block] = bytes(block) if kind == "zero" else rng.bytes(len(b[start : start + block]))
            name = f"{kind}{block}@{start}"
        out.append((name, bytes(b)))
    return out


# ---- structural edits (h5py) --------------------------------------------------------


def _replace(f: h5py.File, name: str, data) -> None:
    del f[name]
    f[name] = data


def _set_row(f: h5py.File, name: str, row: int, value) -> None:
    ds = f[name]
    a = ds[()]
    a[min(row, len(a) - 1)] = value
    ds[...] = a


def _other_dtype(a: np.ndarray) -> np.ndarray:
    """The same rows in another dtype: strings as int16, floats as int32, ints as float64."""
    if a.dtype.kind == "S":
        return np.zeros(a.shape, np.int16)
    return np.nan_to_num(a).astype(np.int32) if a.dtype.kind == "f" else a.astype(np.float64)


def _reverse(f: h5py.File, name: str) -> None:
    f[name][...] = f[name][()][::-1]


def _resize(f: h5py.File, name: str, delta: int) -> None:
    ds = f[name]
    ds.resize(max(0, ds.shape[0] + delta), axis=0)


def structural_edits(f: h5py.File, rng: np.random.Generator) -> list[tuple]:
    """(name, edit) pairs for the file f (opened to learn its datasets); each edit takes an open h5py.File."""
    datasets = []
    f.visititems(lambda n, o: datasets.append(n) if isinstance(o, h5py.Dataset) else None)
    n_req = f["requests/status"].shape[0]
    edits = []
    for name in datasets:
        edits.append((f"delete:{name}", lambda g, n=name: g.__delitem__(n)))
        edits.append((f"retype:{name}", lambda g, n=name: _replace(g, n, _other_dtype(g[n][()]))))
        edits.append((f"shorter:{name}", lambda g, n=name: _resize(g, n, -1)))
        edits.append((f"longer:{name}", lambda g, n=name: _resize(g, n, 1)))
        edits.append((f"group:{name}", lambda g, n=name: (g.__delitem__(n), g.create_group(n))))
    for name in [d for d in datasets if f[d].ndim == 2]:
        edits.append((f"narrower:{name}", lambda g, n=name: _replace(g, n, g[n][()][:, :-1])))
        edits.append((f"1-D:{name}", lambda g, n=name: _replace(g, n, g[n][()][:, 0])))
    for grp in ("requests", "tokens", "prompt"):
        edits.append((f"delete-group:{grp}", lambda g, n=grp: g.__delitem__(n)))
    for attr in list(f.attrs):
        edits.append((f"delete-attr:{attr}", lambda g, a=attr: g.attrs.__delitem__(a)))
    for attr, values in {
        "format_version": [0, 2, "1", 1.5, -1, np.array([1, 1])],
        "format": ["other.trace", 7],
        "topk": [0, 99, -3, "5"],
        "raw_logits": [2, 0, 1],
        "vocab_size": [3, -1, 0],
        "source": ["nope", 1],
        "run": ["{not json", "[1, 2]", b"\xff\xfe"],
        "writer": [5],
        "created_utc": [np.array([1.0, 2.0])],
    }.items():
        for v in values:
            edits.append((f"attr:{attr}={v!r:.20}", lambda g, a=attr, v=v: g.attrs.__setitem__(a, v)))
    row = int(rng.integers(0, max(1, n_req)))
    for name, value in [
        ("requests/token_offset", 10**9),
        ("requests/token_offset", -5),
        ("requests/n_tokens", 10**6),
        ("requests/n_tokens", -1),
        ("requests/prompt_offset", 10**9),
        ("requests/prompt_len", 7 + 10**4),
        ("requests/prompt_len", -2),
        ("requests/key_end", 10**6),
        ("requests/key_end", -1),
        ("requests/status", b"bogus"),
        ("requests/dtype", b"fp64"),
        ("requests/finish_reason", b"\xff\xfe"),
        ("requests/cached_tokens", -5),
        ("requests/http_status", -7),
    ]:
        edits.append((f"value:{name}[{row}]={value!r}", lambda g, n=name, v=value: _set_row(g, n, row, v)))
    edits += [
        ("value:key_bytes not UTF-8", lambda g: _set_row(g, "requests/key_bytes", 0, 0xFF)),
        ("value:empty first key", lambda g: _set_row(g, "requests/key_end", 0, 0) if n_req > 1 else None),
        ("value:all prompt_len -1", lambda g: g["requests/prompt_len"].__setitem__(Ellipsis, -1)),
        ("value:unannounced topk_logit", lambda g: g.attrs.__setitem__("raw_logits", 0)),
        ("value:extra dataset", lambda g: g.create_dataset("tokens/extra", data=np.zeros(3))),
        ("value:swap token_offset rows", lambda g: _reverse(g, "requests/token_offset")),
    ]  # fmt: skip
    return edits


def structural_variants(src: Path, out_dir: Path, rng: np.random.Generator, tag: str) -> list[tuple[str, Path]]:
    with h5py.File(src, "r") as f:
        edits = structural_edits(f, rng)
    out = []
    for i, (name, edit) in enumerate(edits):
        p = out_dir / f"{tag}-s{i:03d}.h5"
        shutil.copyfile(src, p)
        with h5py.File(p, "r+") as g:
            edit(g)
        out.append((f"{tag}:{name}", p))
    return out


def variants(src: Path, out_dir: Path, seed: int, n_bytes: int, tag: str) -> list[tuple[str, Path]]:
    """Every damaged copy of `src`: n_bytes byte-level ones and every structural edit."""
    rng = np.random.default_rng(seed)
    data = src.read_bytes()
    out = []
    for i, (name, b) in enumerate(byte_variants(data, raw_ranges(src), rng, n_bytes)):
        p = out_dir / f"{tag}-b{i:03d}.h5"
        p.write_bytes(b)
        out.append((f"{tag}:{name}", p))
    return out + structural_variants(src, out_dir, rng, tag)


# ---- reading (in the worker) --------------------------------------------------------


def summary(path: str) -> dict:
    """Read a trace as tracekit commands do (inspect, diff, show, resume) and digest what it holds."""
    from tracekit.cli.inspect import summarize
    from tracekit.store import TraceReader, prompt_column, read_token_rows

    summarize(path)
    h = hashlib.sha256()
    with TraceReader(path) as r:
        t = r.requests
        h.update(json.dumps(r.meta.run, sort_keys=True).encode())
        for i in range(len(r)):
            rec = r.record(i)
            h.update(repr(rec).encode())
            toks = r.tokens(i, full_logits=True)
            for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit", "logits"):
                a = getattr(toks, name)
                h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
            p = r.prompt_ids(i)
            h.update(b"-" if p is None else p.tobytes())
        cols = r.columns([c for c in ("token_id", "topk_id") if r.has_column(c)])
        n = r.n_token_rows
        if n:
            read_token_rows(r, "topk_logprob", np.array([0, n - 1, n // 2]))
        prompt_column(r)
        return {
            "requests": len(t),
            "token_rows": n,
            "cols": {k: len(v) for k, v in cols.items()},
            "digest": h.hexdigest(),
        }


def _worker() -> None:
    from tracekit.errors import TraceFormatError

    for line in sys.stdin:
        path = line.rstrip("\n")
        try:
            out = {"outcome": "read", **summary(path)}
        except TraceFormatError as e:
            out = {"outcome": "error", "message": str(e), "type": type(e).__name__}
        except Exception as e:  # the bug this fuzz looks for: record it, go on
            out = {"outcome": "crash", "message": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


def _start() -> tuple[subprocess.Popen, queue.Queue]:
    # FUZZ_TRACEKIT: another checkout's root, to fuzz an older reader (the figures before a fix)
    env = dict(os.environ, PYTHONPATH=os.environ.get("FUZZ_TRACEKIT", str(ROOT)))
    p = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=env["PYTHONPATH"],
    )
    q: queue.Queue = queue.Queue()

    def pump():
        for line in p.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return p, q


def read_all(paths: list[Path], timeout_s: float = 30.0) -> list[dict]:
    """One outcome dict per path, read in a worker subprocess (restarted after a hang or a death)."""
    results: list[dict] = []
    while len(results) < len(paths):
        p, q = _start()
        try:
            for path in paths[len(results) :]:
                p.stdin.write(f"{path}\n")
                p.stdin.flush()
                try:
                    line = q.get(timeout=timeout_s)
                except queue.Empty:
                    results.append({"outcome": "hang", "message": f"no answer in {timeout_s} s"})
                    break
                if line is None:
                    results.append({"outcome": "died", "message": f"worker exited {p.wait()}"})
                    break
                results.append(json.loads(line))
        finally:
            p.kill()
            p.wait()
    return results


def classify(results: list[dict], baseline: dict) -> list[str]:
    """error | same | values | shorter | crash | hang | died, per result."""
    out = []
    for r in results:
        if r["outcome"] != "read":
            out.append(r["outcome"])
        elif r["requests"] != baseline["requests"] or r["token_rows"] != baseline["token_rows"]:
            out.append("shorter")
        else:
            out.append("same" if r["digest"] == baseline["digest"] else "values")
    return out


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
