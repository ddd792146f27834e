"""Child process for the SIGKILL test: appends deterministic requests forever,
printing the count of durable requests after each flush."""

import sys

import numpy as np

from tracekit.schema import Layout, RequestRecord, RunMeta, TokenColumns, prompt_hash
from tracekit.store import TraceWriter


def make_request(i: int, k: int = 8):
    """Request i's deterministic contents: the reader checks every row against these."""
    n = 1 + (i * 7) % 23
    rng = np.random.default_rng(i)
    ids = rng.integers(0, 2048, size=(n, k), dtype=np.int32)
    lps = -np.sort(rng.random((n, k), dtype=np.float32), axis=1) * 5
    toks = TokenColumns(ids[:, 0], lps[:, 0], np.arange(n) * 0.01 + i, ids, lps, lps * 2)
    prompt = np.arange(i % 5 + 3, dtype=np.int32) + i
    rec = RequestRecord(
        key=f"req-{i:05d}",
        prompt_hash=prompt_hash(prompt),
        finish_reason="length",
        cached_tokens=i % 3 - 1,
        t_sent_s=float(i),
        error="é" * (i % 4),
    )
    return rec, toks, prompt


def main(path: str) -> None:
    meta = RunMeta(source="http", run={"model": "kill-test"}, layout=Layout(topk=8, raw_logits=True))
    with TraceWriter(path, meta) as w:
        print("created", flush=True)
        i = 0
        while True:
            w.append(*make_request(i))
            i += 1
            print(f"flushed {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
