"""Small-batch projections fused where the result is bitwise the same: QKV as one GEMM, gate/up as one.

A decode step of B rows runs every projection as a GEMM of M = B rows, and at
M <= 16 cuBLAS reads each weight at 2.2-2.6 TB/s on an H200 (a Qwen3-4B
shape, bench/gpu_study/gemm_floor.py). One GEMM over the concatenated weights
reads them at ~3.0 TB/s: at 8 rows the step's GEMMs take 2.70 instead of 3.10
ms, at one row 2.67 instead of 3.66. Each output element is the same dot
product over the same K, so where cuBLAS (or the CPU BLAS) reduces K in the
same order for both shapes, the fused GEMM's columns are bitwise the separate
GEMMs' outputs. That is not assumed: `fuse` checks it at load, for every
distinct shape, every M from 1 to `max_rows` and the model's dtype, on the
device, and fuses only the groups where every check is bitwise. Larger M (a
prefill) runs the separate GEMMs as before.

How: the fused weight owns the memory and each projection's weight becomes a
view of its rows (no extra memory). Each projection's forward is replaced (an
instance attribute: the module stays what it is): the first projection of a
group called with a new input of at most `max_rows` rows runs the fused GEMM,
and each projection returns its columns as a view (the values its own GEMM
returns; a contiguous copy of each would cost a kernel a projection, as much
as the fusion saves at 8 rows). What consumes them is elementwise (SiLU-mul,
the casts before RMSNorm, the K/V copy into the cache; in FP32, where the
cast is a no-op and RMSNorm's mean would read the view, they are contiguous
copies) or reshapes the
contiguous last dimension, so the step's logits stay bitwise the unfused
step's: tests on CPU, and on CUDA `bench/gpu_study/decode_graphs.py --fusion`
over padded batches at the Qwen3-4B shape. The others reuse the result
when called with the same input tensor (transformers' Llama, Qwen3 and Gemma3
call q/k/v, and gate/up, on one tensor each), and fall back to their own GEMM
otherwise. CUDA graphs capture the fused kernels like any other.

Groups: modules with `q_proj`, `k_proj`, `v_proj` and modules with
`gate_proj`, `up_proj`, all plain `nn.Linear` without bias on one device and
dtype. Anything else is left alone. torch is imported lazily.
"""

from __future__ import annotations

import types

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """One fused group: the weight [sum N, K], each part's columns, the last fused output."""

    def __init__(self, weight, bounds: list[tuple[int, int]], max_rows: int):
        self.weight, self.bounds, self.max_rows = weight, bounds, max_rows
        self.last = None  # (input, fused output, parts served) of the current call
        # FP32: RMSNorm's cast to float32 is a no-op and its mean would reduce over the view itself
        self.contiguous = str(weight.dtype) == "torch.float32"
        self.fused_calls = 0


def _linears(module, names) -> list | None:
    import torch

    parts = [getattr(module, n, None) for n in names]
    if not all(type(p) is torch.nn.Linear and p.bias is None for p in parts):
        return None
    w0 = parts[0].weight
    if any(
        p.weight.shape[1] != w0.shape[1] or p.weight.dtype != w0.dtype or p.weight.device != w0.device for p in parts
    ):
        return None
    return parts


def _bitwise(parts, max_rows: int, seed: int = 0) -> bool:
    """Whether one GEMM over the concatenated weights gives each part's GEMM bitwise, at every
    M from 1 to max_rows (random inputs on the weights' device, in their dtype)."""
    import torch
    import torch.nn.functional as F

    w = torch.cat([p.weight for p in parts])
    k, dev, dt = w.shape[1], w.device, w.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.inference_mode():
        for m in range(1, max_rows + 1):
            x = torch.randn(m, k, device=dev, generator=g).to(dt)
            fused, start = F.linear(x, w), 0
            for p in parts:
                n = p.weight.shape[0]
                if not torch.equal(fused[:, start : start + n], F.linear(x, p.weight)):
                    return False
                start += n
    return True


def _forward(group: _Group, index: int, lin):
    import torch.nn.functional as F

    def forward(self, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > group.max_rows or rows == 0:
            return F.linear(x, self.weight)
        last = group.last
        if last is None or last[0] is not x or index in last[2]:
            last = group.last = (x, F.linear(x, group.weight), set())
            group.fused_calls += 1
        a, b = group.bounds[index]
        last[2].add(index)
        out = last[1][..., a:b]  # a view: the same values as the part's own GEMM (see the docstring)
        if group.contiguous:
            out = out.contiguous()
        if len(last[2]) == len(group.bounds):
            group.last = None  # every part served: drop the references
        return out

    return types.MethodType(forward, lin)


def fuse(model, max_rows: int) -> dict:
    """Fuse every group of `model` whose fused GEMM is bitwise its parts' at M = 1..max_rows.
    Returns the report: groups fused / left, the shapes checked, and why a shape was left."""
    import torch

    checked: dict[tuple, bool] = {}
    fused = left = 0
    groups: list[_Group] = []
    for module in model.modules():
        for names in GROUPS:
            parts = _linears(module, names)
            if parts is None:
                continue
            key = (tuple(tuple(p.weight.shape) for p in parts), str(parts[0].weight.dtype), str(parts[0].weight.device))
            if key not in checked:
                checked[key] = _bitwise(parts, max_rows)
            if not checked[key]:
                left += 1
                continue
            with torch.no_grad():
                w = torch.cat([p.weight.detach() for p in parts])
            bounds, start = [], 0
            for p in parts:
                n = p.weight.shape[0]
                p.weight = torch.nn.Parameter(w[start : start + n], requires_grad=False)  # a view of w's rows
                bounds.append((start, start + n))
                start += n
            group = _Group(w, bounds, max_rows)
            for i, p in enumerate(parts):
                p.forward = _forward(group, i, p)
            groups.append(group)
            fused += 1
    return {
        "groups_fused": fused,
        "groups_left": left,
        "max_rows": max_rows,
        "shapes": [
            {"weights": [list(s) for s in k[0]], "dtype": k[1], "device": k[2], "bitwise": ok}
            for k, ok in checked.items()
        ],
        "_groups": groups,
    }
