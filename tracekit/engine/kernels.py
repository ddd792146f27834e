"""Which attention kernels the engine lets a forward use, and why (CUDA only).

On an H200 (torch 2.11, cuDNN 9.19), torch's SDPA picks cuDNN's kernel for a
one-query attention call, and that kernel was not reproducible run to run: the
same BF16 decode chain gave different logits on every run (up to 0.04 from the
third step; docs/diagnostic.md, "Attention kernels"). A one-token forward
(every decode step) therefore runs with cuDNN left out of SDPA's choices, as
the teacher-forced diagnostic's `sdpa_lower_right` does: torch then takes the
flash kernel (no mask) or the memory-efficient one (a padding mask), both
reproducible there. Prefill forwards keep torch's own choice (cuDNN's square
causal kernel was reproducible). On CPU nothing changes.

This module does not choose anything else (no torch.compile, no deterministic
algorithms switch): it only removes the one kernel measured to be irreproducible.
"""

from __future__ import annotations

import contextlib

DECODE_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # SDPA backends of a one-token step on CUDA


def step_kernels(device, q_len: int, allow_cudnn: bool = False):
    """The context a forward of q_len new tokens per row runs in: on CUDA with q_len == 1,
    SDPA limited to DECODE_BACKENDS (unless allow_cudnn, kept for the measurement that
    shows why); otherwise no restriction."""
    if getattr(device, "type", str(device)) != "cuda" or q_len != 1 or allow_cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in DECODE_BACKENDS])


def describe(device, allow_cudnn: bool = False) -> dict:
    """For the engine's self-report (/v1/models meta.attn_kernels)."""
    if getattr(device, "type", str(device)) != "cuda":
        return {"decode": "torch default", "prefill": "torch default"}
    decode = "torch default (cuDNN allowed)" if allow_cudnn else ",".join(DECODE_BACKENDS).lower()
    return {"decode": decode, "prefill": "torch default"}
