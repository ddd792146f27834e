"""The engine's memory self-report: KV bytes per slot from the model config, and measured use.

`kv_bytes_per_slot` is the prediction a reader can redo from the config alone:
layers x KV heads x head dim x 2 (K and V) x context x dtype bytes, which is
exactly one slot of the executor's KV buffer `[slots, layers, 2, Hkv, context, D]`
(allocated once, at start). `weights_bytes` counts every parameter once (tied
embeddings once). On CUDA, `device_peak_bytes` is torch.cuda.max_memory_allocated
since the process started (weights, the KV buffer, the decode batch's padded copy,
activations, the prefix cache's blocks); `device_total_bytes` is the card's memory.
`fits_lanes(...)` turns these into "N lanes fit a device of S bytes".
"""

from __future__ import annotations


def kv_bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, context: int, dtype_bytes: int) -> int:
    return n_layers * n_kv_heads * head_dim * 2 * context * dtype_bytes


def memory_report(ex) -> dict:
    """ex: a ModelExecutor. Plain ints (bytes) or None where unknown (CPU device figures)."""
    import torch

    elt = ex.kv.element_size()
    per_slot = kv_bytes_per_slot(ex.n_layers, ex.n_kv, ex.head_dim, ex.max_context, elt)
    seen, weights = set(), 0
    for p in ex.model.parameters():  # parameters() already yields a tied tensor once; ids make sure
        if id(p) not in seen:
            seen.add(id(p))
            weights += p.numel() * p.element_size()
    out = {
        "kv_bytes_per_slot": per_slot,
        "kv_formula": f"{ex.n_layers} layers x {ex.n_kv} kv heads x {ex.head_dim} head dim x 2 x "
        f"{ex.max_context} context x {elt} bytes",
        "kv_bytes_allocated": ex.kv.numel() * elt,
        "weights_bytes": weights,
        "device_peak_bytes": None,
        "device_allocated_bytes": None,
        "device_total_bytes": None,
    }
    if ex.device.type == "cuda":
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(ex.device))
        out["device_allocated_bytes"] = int(torch.cuda.memory_allocated(ex.device))
        out["device_total_bytes"] = int(torch.cuda.get_device_properties(ex.device).total_memory)
    return out


def fits_lanes(weights_bytes: int, kv_per_slot: int, lanes: int, device_bytes: int, overhead_bytes: int = 0) -> dict:
    """Whether `lanes` slots of KV plus the weights (plus a measured overhead) fit a device."""
    need = weights_bytes + lanes * kv_per_slot + overhead_bytes
    return {"lanes": lanes, "need_bytes": need, "device_bytes": device_bytes, "fits": need <= device_bytes}
