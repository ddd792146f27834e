"""The floating-point formats tracekit names: one table for every part.

A dtype is named `fp32`, `bf16` or `fp16` everywhere (CLI options, run
metadata, matrix files, trace rows). `ALIASES` is the one table of the other
spellings engines and tools use (torch, HF configs, vLLM/SGLang/TGI reports,
llama.cpp's ftype names); `normalise` and `get` read it, and so does every part
of tracekit that meets a dtype spelled by someone else. This module knows their torch names and
their grids (significand bits, exponent range), which the classifier uses to
count steps between two values; it never imports torch itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str  # tracekit's name: fp32 | bf16 | fp16
    torch_name: str  # attribute of the torch module
    bytes: int  # storage per element
    mantissa_bits: int  # stored significand bits (the implicit leading 1 not counted)


DTYPES: dict[str, DType] = {
    "fp32": DType("fp32", "float32", 4, 23),
    "bf16": DType("bf16", "bfloat16", 2, 7),
    "fp16": DType("fp16", "float16", 2, 10),
}
NAMES = tuple(DTYPES)

# Every spelling of the three formats -> tracekit's name. Matched after strip(), lower() and
# removing a "torch." prefix; "auto" and the like are not a dtype (normalise gives None).
ALIASES: dict[str, str] = {
    **{s: "fp32" for s in ("fp32", "float32", "f32", "float", "all f32")},
    **{s: "bf16" for s in ("bf16", "bfloat16", "mostly bf16")},
    **{s: "fp16" for s in ("fp16", "float16", "f16", "half", "mostly f16")},
}


# llama.cpp ftype names (llama_model_ftype_name) and other weight formats with no float grid:
# quantized weights (Q4_0, Q8_0, Q4_K - Medium, IQ2_XS, ...), FP8, AWQ, GPTQ. Their logits lie
# on no grid tracekit knows; such runs are recorded as quantized and judged by calibration.
QUANTIZED_PREFIXES = ("q", "iq", "tq", "fp8", "f8", "e4m3", "e5m2", "awq", "gptq", "int8", "int4", "mxfp4", "nvfp4")


def quantized(value: object) -> str | None:
    """The quantized format a dtype label names ('Q8_0', 'mostly Q4_K - Medium', 'fp8_e4m3'), else None."""
    if not isinstance(value, str):
        return None
    v = value.strip().lower().removeprefix("mostly ").removeprefix("torch.")
    return value.strip() if v.startswith(QUANTIZED_PREFIXES) and normalise(value) is None else None


def normalise(value: object) -> str | None:
    """'torch.bfloat16', 'BF16', 'bfloat16', llama.cpp's 'all F32' ... -> 'bf16' / 'fp32'; None for
    anything else ('auto', '', a non-string)."""
    if not isinstance(value, str):
        return None
    return ALIASES.get(value.strip().lower().removeprefix("torch."))


def get(name: str, where: str = "dtype") -> DType:
    """The DType called `name` (any spelling of ALIASES); anything else is a ConfigError listing
    the choices."""
    d = DTYPES.get(normalise(name) or "")
    if d is None:
        raise ConfigError(f"{where} {name!r}: expected one of {', '.join(NAMES)}")
    return d


def torch_dtype(name: str):
    """The torch dtype of `name` (imports torch)."""
    import torch

    return getattr(torch, get(name).torch_name)
