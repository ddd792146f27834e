"""One test per field the llamacpp dialect reads: llama.cpp 0c1e570, native /completion. Its
transcripts are recordings of llama-server (fixtures/transcripts/README.md cites repository, file
and commit); every docstring names the source file a field was read from. Shared setup:
dialect_fields_shared.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.dialect_fields_shared import (
    IDS,
    LPS,
    TOP_IDS,
    TOP_LPS,
    body_of,
    parse_with,
)
from support.replay import routes_for

from tracekit.errors import ResponseShapeError

LLAMA = ["llamacpp-stream", "llamacpp-nonstream"]


@pytest.mark.parametrize("variant", LLAMA)
def test_llamacpp_ids_and_logprobs(captured, variant):
    """`completion_probabilities[].{id, logprob}`: one element per stream event, all of them in
    the non-stream body. Source: tools/server/server-task.cpp (probs_vector_to_json;
    server_task_result_cmpl_partial::to_json_non_oaicompat)."""
    tok = captured(variant)["tok"]
    assert captured(variant)["s"].dialect == "llamacpp" and tok.token_id.tolist() == IDS
    np.testing.assert_allclose(tok.logprob, LPS, atol=2e-5)  # the stream recording differs at ~1e-7


@pytest.mark.parametrize("variant", LLAMA)
def test_llamacpp_top_logprobs(captured, variant):
    """`completion_probabilities[].top_logprobs[].{id, logprob}`. Source:
    tools/server/server-task.cpp (completion_token_output::to_json)."""
    tok = captured(variant)["tok"]
    np.testing.assert_array_equal(tok.topk_id, TOP_IDS)
    np.testing.assert_allclose(tok.topk_logprob, TOP_LPS, atol=2e-5)


@pytest.mark.parametrize("variant,want", [("llamacpp-stream", 9), ("llamacpp-nonstream", 0)])
def test_llamacpp_cache_n(captured, variant, want):
    """`timings.cache_n` of the final result is the reused prefix (the last prompt token is always
    re-run); `tokens_cached` is the slot's whole cache after the request and is not read. Source:
    tools/server/server-task.cpp (to_json_non_oaicompat: tokens_cached, timings), the recording
    (README rows)."""
    assert captured(variant)["rec"].cached_tokens == want  # tokens_cached is 21 in the non-stream body


@pytest.mark.parametrize("variant", LLAMA)
def test_llamacpp_stop_type(captured, variant):
    """`stop_type` of the final result: `limit` -> length, `eos` and `word` -> stop. Source:
    tools/server/server-task.cpp (stop_type_to_str: none, eos, limit, word)."""
    assert captured(variant)["rec"].finish_reason == "length"
    for name, want in (("eos", "stop"), ("word", "stop"), ("limit", "length")):
        obj = body_of("llamacpp-server__completion__nonstream.http")
        obj["stop_type"] = name
        acc, _ = parse_with("llamacpp", [obj])
        assert acc.finish_reason == want and acc.done


def test_llamacpp_stream_ends_with_the_stop_event(one):
    """/completion streams have no `[DONE]`: the result with `stop: true` is the last; a stream
    without it is cut, an error row. Source: tools/server/server-task.cpp
    (server_task_result_cmpl_final::to_json_non_oaicompat: "stop": true)."""
    c = one(routes_for("llamacpp"), "FAULT:nodone", True)
    assert c["rec"].status == "error" and "final event" in c["rec"].error


def test_llamacpp_post_sampling_probabilities_are_not_taken_as_logprobs():
    """With `post_sampling_probs` llama.cpp sends `prob` / `top_probs` (probabilities after its
    samplers) instead of `logprob` / `top_logprobs`: the dialect refuses that shape rather than
    store probabilities as logprobs. Source: tools/server/server-task.cpp (probs_vector_to_json:
    post_sampling_probs ? "prob" : "logprob")."""
    obj = body_of("llamacpp-server__completion__nonstream.http")
    for e in obj["completion_probabilities"]:
        e["prob"] = float(np.exp(e.pop("logprob")))
        e["top_probs"] = [{"id": t["id"], "prob": float(np.exp(t["logprob"]))} for t in e.pop("top_logprobs")]
    with pytest.raises(ResponseShapeError):
        parse_with("llamacpp", [obj])
