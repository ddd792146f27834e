"""`sdpa_lower_right`: SDPA that keeps the flash kernel for a segment on a cache.

transformers' `sdpa` attention can only pass `is_causal=True` when the query
and key lengths are equal (or the query is one token): for a later segment of
`prefix:B` or `chunked:C` (q_len < kv_len) it builds an explicit 4-D boolean
mask and expands the grouped K/V heads (`repeat_kv`), and torch's SDPA then
cannot run the flash kernel (a mask rules it out), so it falls back to the
memory-efficient or math kernel. For a no-padding batch, which is all the
diagnostic ever runs, the mask is exactly a lower-right-aligned causal mask,
and torch has a name for that: `torch.nn.attention.bias.causal_lower_right`,
which SDPA runs with the flash kernel (whose causal mask is lower-right
aligned) and GQA natively on CUDA, and as a materialised boolean mask on CPU.

    q_len == kv_len      transformers' sdpa, is_causal=True (unchanged)
    q_len == 1           transformers' sdpa, no mask        (CUDA: no cuDNN kernel)
    1 < q_len < kv_len   CUDA, q >= kv/3: the square causal call over
                         front-padded queries (`full`'s kernel)
                         otherwise: causal_lower_right(q, kv) (CPU: a 4-D mask)

Any call that does carry a mask (padding) also goes to transformers' own
`sdpa` function unchanged. On CPU the result is bitwise that of `sdpa`
(tested). On CUDA, the later segments of `prefix:B` and `chunked:C` run a
flash kernel instead of a masked one (BF16 logits move by about as much as
the history itself moves them; see docs/diagnostic.md): a long segment
(q >= kv/3) is computed as the square causal attention that `full` runs,
over kv - q zero queries and then its own, whose rows are bitwise the rows
`full` computes from the same q, k, v (measured on an H200) and which is
faster there than torch's lower-right (FA2) kernel; a short one by FA2.
One-token steps keep transformers' call but not cuDNN's kernel, which is
not reproducible run to run on an H200 (_no_cudnn).
`register()` adds the name to transformers' AttentionInterface and
AttentionMaskInterface; load a model with `attn_implementation=NAME`.
"""

from __future__ import annotations

NAME = "sdpa_lower_right"


def lower_right_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """query [N, H, q, D], key/value [N, Hkv, kv, D] -> ([N, q, H, D], None)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if (
        attention_mask is not None
        or kwargs.get("position_bias") is not None
        or not 1 < q_len < kv_len
        or not getattr(module, "is_causal", True)
        or is_causal is False
    ):
        # Everything but a segment on a cache is transformers' own sdpa call,
        # exactly as `sdpa` makes it when its mask builder skips the mask
        # (q_len == kv_len or q_len == 1, no padding), so those numerics stay;
        # except that a one-token step on CUDA may not take cuDNN's kernel,
        # which is not reproducible there (_no_cudnn).
        import contextlib

        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_no_cudnn()) if q_len == 1 and query.is_cuda else contextlib.nullcontext():
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
    groups = getattr(module, "num_key_value_groups", 1)
    if query.is_cuda and SQUARE_FROM * q_len >= kv_len:
        return _square(query, key, value, dropout, scaling, groups), None
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q_len, kv_len)
    if groups > 1 and query.is_cuda and not _flash_ok(query, key, value, dropout):
        # CausalBias' non-flash CUDA path (memory-efficient kernel) takes no
        # grouped K/V: expand them, as transformers' sdpa does with a mask.
        from transformers.integrations.sdpa_attention import repeat_kv

        key, value, groups = repeat_kv(key, groups), repeat_kv(value, groups), 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=False, scale=scaling, enable_gqa=groups > 1
    )
    return out.transpose(1, 2).contiguous(), None


def _no_cudnn():
    """SDPA backends for a one-token step on CUDA: all but cuDNN.

    Measured on an H200 (torch 2.11, cuDNN 9.19, a Qwen3-0.6B shape in
    BF16, 4 sequences): with cuDNN allowed (torch's default choice there)
    the same 32-step decode chain gave different logits on every run, up to
    0.04 from the third step; with the flash or the math kernel it was
    bitwise the same on every run. `full` and prefix segments (cuDNN's
    square kernel) were reproducible."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


SQUARE_FROM = 3  # CUDA: q >= kv / 3 runs as the square causal kernel over front-padded queries


def _square(query, key, value, dropout: float, scaling, groups: int):
    """Causal attention of q queries on kv keys (lower-right aligned) as the
    square causal SDPA call over kv queries, the first kv - q of them zeros,
    keeping the last q rows: query r sits at row kv - q + r and sees keys
    0 .. kv - q + r, the lower-right pattern. It is the call `full` makes
    (is_causal, q = kv), which torch runs with its fastest kernel (cuDNN's
    Hopper flash on an H200); each row's result does not depend on the
    padding rows (flash kernels keep one running softmax per row). It does
    the padding rows' work too: worth it from q >= kv / 3, where torch's
    lower-right (FA2) kernel, 2-3x slower per FLOP there, costs more."""
    import torch

    n, h, q_len, d = query.shape
    kv_len = key.shape[2]
    # In the queries' own memory layout: transformers' are [N, q, H, D] in
    # memory, viewed as [N, H, q, D]; a copy in that layout is a plain one.
    padded = query.new_empty((n, kv_len, h, d)).transpose(1, 2)
    padded[:, :, : kv_len - q_len].zero_()
    padded[:, :, kv_len - q_len :].copy_(query)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=groups > 1
    )
    return out[:, :, kv_len - q_len :].transpose(1, 2).contiguous()


def _flash_ok(query, key, value, dropout: float) -> bool:
    """Whether torch's flash kernel takes these inputs (grouped K/V included)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(query, key, value, None, dropout, False, True)))


def _no_padding_mask(*args, attention_mask=None, **kwargs):
    """The mask builder for NAME: None (the attention function applies the
    causal pattern itself) unless a 2-D padding mask masks something; then
    transformers' own sdpa mask, which lower_right_sdpa hands to sdpa."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make NAME a valid `attn_implementation` (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, lower_right_sdpa)
    AttentionMaskInterface.register(NAME, _no_padding_mask)
    return NAME
