"""The dtype an engine reports, as the capture records it (`dtype`, `dtype_source`).

Why it matters: the classifier counts steps on the grid this names; llama.cpp's F32 GGUF
judged on an assumed BF16 grid turned batched-path drift into "ties", and a quantized model
has no float grid at all."""

from __future__ import annotations

import asyncio

from tracekit.capture.runmeta import engine_numerics, resolve_dtype


def _found(meta: dict, dialect: str = "llamacpp") -> dict:
    # the llama.cpp branch reads the probe's stored /v1/models answer: no request is sent
    return asyncio.run(engine_numerics(None, "http://127.0.0.1:1", dialect, {"v1_models": {"meta": meta}}))


def test_llamacpp_ftype_names_the_grid():
    for ftype, want in (("all F32", "fp32"), ("BF16", "bf16"), ("F16", "fp16"), ("mostly F16", "fp16")):
        f = _found({"ftype": ftype})
        dtype, source = resolve_dtype(None, None, f)
        assert (dtype, source) == (want, f"engine: /v1/models meta.ftype {ftype!r}")


def test_quantized_gguf_is_recorded_as_quantized_not_as_bf16():
    dtype, source = resolve_dtype(None, None, _found({"ftype": "Q4_K - Medium"}))
    assert dtype is None and source.startswith("quantized: the engine reports Q4_K - Medium")
    assert "--calibration" in source


def test_a_label_that_contradicts_the_engine_is_refused():
    import pytest

    from tracekit.errors import ConfigError

    with pytest.raises(ConfigError, match="the engine reports fp32"):
        resolve_dtype("bf16", None, _found({"ftype": "all F32"}))
