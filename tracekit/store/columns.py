"""Names, dtypes, widths and chunk sizes of the v1 columns (docs/format.md describes them).

The writer creates exactly these and the reader checks exactly these: one table for both.
"""

import numpy as np

from ..dtypes import NAMES as DTYPE_NAMES
from ..schema import STATUSES

# name -> (numpy dtype, default) of fixed-width request columns.
FIXED = {
    "prompt_hash": ("S64", b""),
    "status": ("S9", b""),
    "http_status": ("<i2", -1),
    "finish_reason": ("S16", b""),
    "cached_tokens": ("<i4", -1),
    "prompt_len": ("<i4", -1),
    "t_sent_s": ("<f8", np.nan),
    "t_first_token_s": ("<f8", np.nan),
    "t_done_s": ("<f8", np.nan),
    "dtype": ("S8", b""),
    "token_offset": ("<i8", 0),
    "n_tokens": ("<i4", 0),
    "prompt_offset": ("<i8", 0),
}
# Ragged UTF-8 string columns: `<name>_bytes` (uint8) + `<name>_end` (int64 end offsets).
RAGGED = ("key", "error", "history", "params", "prompt_text")
# Fixed-width string columns holding an enumeration: the values a row may hold.
ENUMS = {"status": STATUSES, "dtype": ("",) + DTYPE_NAMES}
# Per-position columns: 1-D [N] and top-k [N, k]; `topk_logit` only with raw logits,
# `logits` [N, V] only with a vocabulary width.
TOKEN_1D = {"token_id": "<i4", "logprob": "<f4", "t_arrival_s": "<f8"}
TOKEN_TOPK = {"topk_id": "<i4", "topk_logprob": "<f4", "topk_logit": "<f4"}
TOKEN_COLUMNS = tuple(TOKEN_1D) + tuple(TOKEN_TOPK) + ("logits",)
PROMPT_DTYPE = "<i4"
# /rowcheck, in traces with top-k: the row checks of every token row (tracekit/rowcheck.py), written
# with the rows; the root attribute `rowcheck` holds the limits they were computed with.
ROWCHECK = {"topk_lp": "<f4", "flags": "u1"}

# The root attribute `checksum` of a trace whose every chunked dataset carries HDF5's Fletcher-32
# filter (written since tracekit 0.1.x; a v1 file without the attribute predates it).
CHECKSUM = "fletcher32"

# Chunk sizes: a flush writes (and checksums) the chunk being filled whole, so a capture that
# flushes after every request rewrites up to one chunk a column each time; 256 KiB keeps that
# small while whole-column reads stay at the .npy floor's speed (bench/store_bench.py).
REQ_CHUNK = 256
TOK_CHUNK_ROWS = 1 << 15  # 1-D token columns: 32K rows a chunk (128 KiB of int32)
TOPK_CHUNK_BYTES = 1 << 18  # [N, k] columns: about 256 KiB a chunk (small traces: repacked at close)
