"""Names, dtypes and chunk sizes of the v1 columns (docs/format.md describes them)."""

import numpy as np

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
RAGGED = ("key", "error", "history", "params", "prompt_text")
REQ_CHUNK = 256
TOK_CHUNK_ROWS = 1 << 16  # 1-D token columns: 64K rows a chunk (256 KiB of int32)
TOPK_CHUNK_BYTES = 1 << 20  # [N, k] columns: about 1 MiB a chunk (small traces: see expected_tokens)
