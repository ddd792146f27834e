"""One test per field the sglang dialect reads: SGLang 0.5.23, native /generate, /tokenize,
/server_info and /model_info. Its transcripts are constructed from the response models of SGLang's
source (fixtures/transcripts/README.md cites repository, file and commit); every docstring names
the source file a field was read from. Shared setup: dialect_fields_shared.py; the
`captured` and `one` fixtures: conftest.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from support.dialect_fields_shared import (
    IDS,
    LPS,
    PROMPT,
    PROMPT_IDS,
    TOP_IDS,
    TOP_LPS,
    body_of,
    capture_one,
    events_of,
    parse_with,
)
from support.replay import load, routes_for

from tracekit.capture.dialects import RequestSpec, get

SGLANG = ["sglang-stream", "sglang-stream-incremental", "sglang-nonstream"]


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_output_token_logprobs(captured, variant):
    """`meta_info.output_token_logprobs` = [[logprob, id, text|null]] give the chosen ids and
    logprobs, in cumulative and incremental streams alike. Source:
    sglang/srt/managers/tokenizer_manager.py (detokenize_logprob_tokens, add_logprob_to_meta_info)."""
    tok = captured(variant)["tok"]
    assert captured(variant)["s"].dialect == "sglang" and tok.token_id.tolist() == IDS
    np.testing.assert_array_equal(tok.logprob, LPS)


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_output_top_logprobs(captured, variant):
    """`meta_info.output_top_logprobs` = one list of [logprob, id, text|null] a token. Source:
    sglang/srt/managers/tokenizer_manager.py (detokenize_top_logprobs_tokens)."""
    tok = captured(variant)["tok"]
    np.testing.assert_array_equal(tok.topk_id, TOP_IDS)
    np.testing.assert_array_equal(tok.topk_logprob, TOP_LPS)


def test_sglang_null_top_logprobs_row():
    """A position without top entries is `null` in `output_top_logprobs`: that token has no
    candidates (-1 / NaN), its neighbours keep theirs. Source:
    sglang/srt/managers/tokenizer_manager.py (detokenize_top_logprobs_tokens: ret.append(None))."""
    body = body_of("sglang__generate__nonstream.http")
    body["meta_info"]["output_top_logprobs"][3] = None
    _, cols = parse_with("sglang", [body])
    assert cols.token_id.tolist() == IDS and (cols.topk_id[3] == -1).all() and np.isnan(cols.topk_logprob[3]).all()
    np.testing.assert_array_equal(np.delete(cols.topk_id, 3, 0), np.delete(TOP_IDS, 3, 0))


def test_sglang_completion_tokens_tells_cumulative_from_incremental():
    """`meta_info.completion_tokens` is cumulative in both modes; the logprob lists are cumulative
    by default and only the new entries with --incremental-streaming-output. The dialect takes
    only what it has not seen. Source: sglang/srt/managers/tokenizer_manager.py
    (_INCREMENTAL_STREAMING_META_INFO_KEYS, _slice_streaming_output_meta_info)."""
    for name, entries in (("sglang__generate__stream.http", 78), ("sglang__generate__stream-incremental.http", 12)):
        events = events_of(name)
        assert sum(len(ev["meta_info"]["output_token_logprobs"]) for ev in events) == entries
        assert [ev["meta_info"]["completion_tokens"] for ev in events] == list(range(1, 13))
        _, cols = parse_with("sglang", events)
        assert cols.token_id.tolist() == IDS


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_cached_tokens(captured, variant):
    """`meta_info.cached_tokens`, on every answer of the native route (no flag needed; the OpenAI
    routes report it only with --enable-cache-report). Source:
    sglang/srt/managers/tokenizer_manager.py (meta_info "cached_tokens"),
    sglang/srt/entrypoints/openai/usage_processor.py (enable_cache_report)."""
    assert captured(variant)["rec"].cached_tokens == 9


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_prompt_token_ids(captured, variant):
    """A text prompt asks `return_prompt_token_ids`; every answer (each stream event, cumulative
    or incremental) then carries the tokenized input as a top-level `prompt_token_ids`, stored as
    the prompt's ids. Source: sglang/api/v1/api_types.py (GenerateRequest.return_prompt_token_ids),
    sglang/srt/managers/tokenizer_manager.py (state.prompt_token_ids = tokenized_obj.input_ids;
    out_dict["prompt_token_ids"] in _handle_batch_output)."""
    c = captured(variant)
    assert c["pids"] == PROMPT_IDS and c["run"]["prompt_ids"].startswith("the response's prompt_token_ids")
    assert c["sent"][-1]["body"]["return_prompt_token_ids"] is True


def test_sglang_tokenize_shape():
    """POST /tokenize takes `{prompt, add_special_tokens}` (default true, as /generate encodes a
    text) and answers `{tokens, count, max_model_len}`; tracekit reads `tokens`. Source:
    sglang/srt/entrypoints/openai/protocol.py (TokenizeRequest, TokenizeResponse),
    sglang/srt/entrypoints/openai/serving_tokenize.py, sglang/srt/entrypoints/http_server.py
    (/tokenize and /v1/tokenize)."""
    from tracekit.capture.client import _TOKENIZE

    route, body, ids_of = _TOKENIZE["sglang"]
    t = load("sglang__tokenize.http")
    assert route == t.path and body(PROMPT) == json.loads(t.request)
    assert ids_of(json.loads(t.body)) == PROMPT_IDS


def _json_route(body) -> object:
    return dataclasses.replace(load("sglang__v1-models.http"), body=json.dumps(body).encode())


@pytest.mark.parametrize(
    "routes,source",
    [
        ({"/server_info": "bfloat16", "/get_server_info": "float16"}, "engine: /server_info dtype"),
        ({"/get_server_info": "bfloat16"}, "engine: /get_server_info dtype"),
    ],
)
def test_sglang_dtype_from_server_info(tmp_path, routes, source):
    """The dtype from `/server_info` (the resolved server arguments: `dtype`), else from
    `/get_server_info`, its deprecated alias (a warning in the server's log on every call), the
    only name in older SGLang. Source: sglang/srt/entrypoints/http_server.py (get_server_info ->
    server_info), sglang/srt/utils/common.py (build_server_info: server_args.resolved_dict())."""
    extra = {("GET", path): _json_route({"dtype": dt, "version": "0.5.23"}) for path, dt in routes.items()}
    c = capture_one(tmp_path / "r.h5", {**routes_for("sglang"), **extra}, PROMPT, False)
    assert c["run"]["dtype"] == "bf16" and c["run"]["dtype_source"] == source


def test_sglang_found_by_model_info(tmp_path):
    """Without `owned_by: sglang` (a proxy in front of it), SGLang is found by `/model_info`, or
    `/get_model_info`, its deprecated alias. Source: sglang/srt/entrypoints/http_server.py
    (get_model_info -> model_info, "model_path")."""
    models = load("sglang__v1-models.http")
    other = dataclasses.replace(models, body=models.body.replace(b'"owned_by":"sglang"', b'"owned_by":"proxy"'))
    info = _json_route({"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True})
    routes = {**routes_for("sglang"), ("GET", "/v1/models"): other, ("GET", "/model_info"): info}
    c = capture_one(tmp_path / "r.h5", routes, PROMPT, True)
    assert c["run"]["dialect"] == "sglang" and c["run"]["dialect_reason"] == "/model_info answered (SGLang)"
    assert c["run"]["engine_family"] == "sglang" and c["rec"].status == "ok"


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_finish_reason(captured, variant):
    """`meta_info.finish_reason` is an object whose `type` is the reason: `{"type": "length",
    "length": N}`, `{"type": "stop", "matched": id}` for a stop token (EOS included), null until
    the end. Source: sglang/srt/managers/schedule_batch.py (FINISH_LENGTH, FINISH_MATCHED_TOKEN)."""
    assert captured(variant)["rec"].finish_reason == "length"
    body = body_of("sglang__generate__nonstream.http")
    body["meta_info"]["finish_reason"] = {"type": "stop", "matched": 0}
    acc, _ = parse_with("sglang", [body])
    assert acc.finish_reason == "stop"


def test_sglang_stream_ends_with_done(one):
    """/generate streams end with `data: [DONE]`; one without it is cut, an error row. Source:
    sglang/srt/entrypoints/http_server.py (stream_results: yield b"data: [DONE]\\n\\n")."""
    c = one(routes_for("sglang"), "FAULT:nodone", True)
    assert c["rec"].status == "error" and "[DONE]" in c["rec"].error


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_sglang_request_passes_the_generate_contract(ignore_eos):
    """SGLang checks /generate bodies against its API contract before anything runs: unknown
    top-level keys are ignored, unknown `sampling_params` keys are refused (400). The dialect's
    body uses known keys only. Source: sglang/api/v1/api_types.py (GenerateRequest "unknown keys
    ignored", SamplingParams "unknown keys rejected"), sglang/srt/entrypoints/http_server.py
    (generate_contract_error -> 400)."""
    sampling_fields = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                       "ignore_eos", "skip_special_tokens", "no_stop_trim", "n"}  # fmt: skip
    request_fields = {"rid", "text", "input_ids", "stream", "sampling_params", "return_logprob",
                      "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                      "return_prompt_token_ids"}  # fmt: skip
    for prompt in (PROMPT, PROMPT_IDS):
        body = get("sglang").body(RequestSpec("a", prompt, 12, 5, ignore_eos, True))
        assert set(body) <= request_fields and set(body["sampling_params"]) <= sampling_fields
        assert body["logprob_start_len"] == -1 and body["return_logprob"] is True
