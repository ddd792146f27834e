"""The run record (tracekit.runrecord) and the one dtype alias table (tracekit.dtypes)."""

import pytest

from tracekit import dtypes
from tracekit.errors import SchemaVersionError, TraceFormatError
from tracekit.runrecord import RUN_VERSION, RunRecord
from tracekit.store import TraceReader

CAPTURE = "fixtures/format/v1/capture.h5"


@pytest.mark.parametrize(
    "spelled,name",
    [
        ("fp32", "fp32"), ("float32", "fp32"), ("f32", "fp32"), ("torch.float32", "fp32"), ("all F32", "fp32"),
        ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("BF16", "bf16"),
        ("fp16", "fp16"), ("float16", "fp16"), ("f16", "fp16"), ("half", "fp16"), ("F16", "fp16"),
        ("auto", None), ("", None), (None, None),
    ],
)  # fmt: skip
def test_one_alias_table(spelled, name):
    assert dtypes.normalise(spelled) == name
    if name:
        assert dtypes.get(spelled).name == name


def test_an_old_trace_reads_as_version_1_with_its_facts():
    with TraceReader(CAPTURE) as r:
        rec = r.meta.record
    assert "run_version" not in r.meta.run and rec.version == RUN_VERSION == 1
    assert rec.dialect == "vllm" and rec.concurrency == 4 and rec.eos_token_ids == (0,) and rec.model == "tiny"
    assert rec.cache.setting == "unknown" and rec.cache.block_size == 16 and rec.cache.prefix_cache is True
    assert rec.dtype_claims()[0] == ("engine self-report (logits_dtype)", "fp32")
    assert rec.engine.name == "tracekit"


def test_round_trip_and_validation():
    rec = RunRecord.from_json({"dialect": "tgi", "cache": "off", "dtype": "BF16", "tool": "x"})
    assert rec.cache.prefix_cache is False and rec.dtype.name == "bf16" and rec.extra == {"tool": "x"}
    assert RunRecord.from_json(rec.to_json()) == rec
    with pytest.raises(SchemaVersionError, match="version 2"):
        RunRecord.from_json({"run_version": 2})
    with pytest.raises(TraceFormatError, match="eos_token_ids"):
        RunRecord.from_json({"eos_token_ids": "0"})


def test_quantized_labels_are_recognised_and_never_taken_for_a_float_grid():
    """llama.cpp's ftype of a Q8_0 / Q4_K GGUF (or an FP8 checkpoint) names no float grid: such
    a run is recorded as quantized, never silently judged as BF16."""
    from tracekit.dtypes import normalise, quantized

    for label in ("Q8_0", "Q4_K - Medium", "mostly Q4_0", "IQ2_XS", "fp8_e4m3", "AWQ"):
        assert quantized(label) and normalise(label) is None, label
    for label in ("all F32", "BF16", "F16", "bfloat16", "torch.float32"):
        assert quantized(label) is None and normalise(label) is not None, label
