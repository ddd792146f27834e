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

REQ_CHUNK = 256
TOK_CHUNK_ROWS = 1 << 16  # 1-D token columns: 64K rows a chunk (256 KiB of int32)
TOPK_CHUNK_BYTES = 1 << 20  # [N, k] columns: about 1 MiB a chunk (small traces: repacked at close)
