"""One test per field the vllm dialect reads: vLLM 0.33.0, /v1/completions with
return_tokens_as_token_ids and return_token_ids. Its transcripts are constructed from the response
models of vLLM's source (fixtures/transcripts/README.md cites repository, file and commit); every
docstring names the source file a field was read from. Shared setup: dialect_fields_shared.py; the
`captured` and `one` fixtures: conftest.py."""

from __future__ import annotations

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
    events_of,
    parse_with,
    routes_with,
)
from support.replay import routes_for


@pytest.mark.parametrize("variant", ["vllm-stream", "vllm-nonstream"])
def test_vllm_token_ids(captured, variant):
    """`choices[].token_ids` (with `return_token_ids`; the delta per stream chunk) are the chosen
    ids. Source: vllm/entrypoints/openai/completion/protocol.py (CompletionResponseChoice,
    CompletionResponseStreamChoice .token_ids) and completion/serving.py."""
    c = captured(variant)
    assert c["s"].dialect == "vllm" and c["tok"].token_id.tolist() == IDS


def test_vllm_token_id_strings_without_token_ids():
    """Without `token_ids` (a vLLM before return_token_ids), the chosen ids come from the
    `"token_id:N"` strings of `logprobs.tokens`. Source: vllm/entrypoints/generate/base/serving.py
    (format_token_id_placeholder: f"token_id:{token_id}")."""
    events = events_of("vllm__v1-completions__stream.http")
    for ev in events:
        for ch in ev["choices"]:
            del ch["token_ids"]
    acc, cols = parse_with("vllm", events)
    assert acc.str_ids and cols.token_id.tolist() == IDS


@pytest.mark.parametrize("variant", ["vllm-stream", "vllm-nonstream"])
def test_vllm_token_logprobs(captured, variant):
    """`logprobs.token_logprobs` are the chosen tokens' logprobs (floored at -9999.0 by the
    server). Source: vllm/entrypoints/openai/completion/serving.py (_create_completion_logprobs)."""
    np.testing.assert_array_equal(captured(variant)["tok"].logprob, LPS)


@pytest.mark.parametrize("variant", ["vllm-stream", "vllm-nonstream"])
def test_vllm_top_logprobs(captured, variant):
    """`logprobs.top_logprobs` dicts keyed `"token_id:N"` are the top-k ids and logprobs.
    Source: vllm/entrypoints/openai/completion/protocol.py (CompletionLogProbs.top_logprobs:
    list[dict[str, float] | None]) and completion/serving.py (return_as_token_id keys)."""
    tok = captured(variant)["tok"]
    np.testing.assert_array_equal(tok.topk_id, TOP_IDS)
    np.testing.assert_array_equal(tok.topk_logprob, TOP_LPS)


def test_vllm_sampled_token_first_is_put_in_rank_order():
    """A sampled (not greedy) token comes first in its top dict, then the top-k: k entries when it
    is among them, k + 1 when not. The trace keeps rank order and the sampled token as chosen.
    Source: vllm/v1/sample/sampler.py (gather_logprobs: sampled token, then topk),
    vllm/logprobs.py (append_logprobs_for_next_position), vllm/entrypoints/generate/base/serving.py
    (completion_top_logprobs_limit: logprobs + 1). The outside token's value is made up."""
    body = body_of("vllm__v1-completions__nonstream.http")
    ch, lp = body["choices"][0], body["choices"][0]["logprobs"]
    keys = [f"token_id:{i}" for i in TOP_IDS[0]]
    second = keys[1]  # position 0 sampled the 2nd candidate: it comes first, the dict has k entries
    lp["top_logprobs"][0] = {second: lp["top_logprobs"][0][second], **lp["top_logprobs"][0]}
    lp["tokens"][0], lp["token_logprobs"][0], ch["token_ids"][0] = second, float(TOP_LPS[0, 1]), int(TOP_IDS[0, 1])
    # position 1 sampled a token outside the top-k: first, then the k others (k + 1 entries)
    lp["top_logprobs"][1] = {"token_id:1999": -9.0, **lp["top_logprobs"][1]}
    lp["tokens"][1], lp["token_logprobs"][1], ch["token_ids"][1] = "token_id:1999", -9.0, 1999
    assert list(lp["top_logprobs"][0]) != keys and len(lp["top_logprobs"][1]) == 6
    _, cols = parse_with("vllm", [body])
    assert cols.token_id[:2].tolist() == [TOP_IDS[0, 1], 1999]
    np.testing.assert_array_equal(cols.topk_id[:2], TOP_IDS[:2])
    np.testing.assert_array_equal(cols.topk_logprob[:2], TOP_LPS[:2])


@pytest.mark.parametrize("variant", ["vllm-stream", "vllm-nonstream"])
def test_vllm_prompt_token_ids(captured, variant):
    """`choices[].prompt_token_ids` (return_token_ids) are the prompt's ids from the engine; a
    stream sends them on the first chunk only and explicit nulls after it. Source:
    vllm/entrypoints/openai/completion/protocol.py (return_token_ids: "prompt_token_ids is
    included only in the first chunk") and completion/serving.py (model_dump_json(exclude_unset))."""
    c = captured(variant)
    assert c["pids"] == PROMPT_IDS and "prompt_token_ids" in c["run"]["prompt_ids"]
    if variant == "vllm-stream":
        nulls = [ev["choices"][0]["prompt_token_ids"] for ev in events_of("vllm__v1-completions__stream.http")[1:-1]]
        assert nulls == [None] * 11


@pytest.mark.parametrize("variant", ["vllm-stream", "vllm-nonstream"])
def test_vllm_finish_reason(captured, variant):
    """`choices[].finish_reason` (on the last token chunk in a stream). Source:
    vllm/entrypoints/openai/completion/protocol.py (finish_reason: str | None)."""
    assert captured(variant)["rec"].finish_reason == "length"


@pytest.mark.parametrize("variant,want", [("vllm-stream", 8), ("vllm-nonstream-cached", 8), ("vllm-nonstream", -1)])
def test_vllm_cached_tokens(captured, variant, want):
    """`usage.prompt_tokens_details.cached_tokens`, only with --enable-prompt-tokens-details (in a
    stream on the last, `choices: []` chunk); without the flag `prompt_tokens_details` is null and
    the count stays unknown (-1), never 0. Source: vllm/entrypoints/openai/completion/serving.py
    (enable_prompt_tokens_details), vllm/entrypoints/serve/engine/protocol.py (UsageInfo,
    PromptTokenUsageInfo)."""
    assert captured(variant)["rec"].cached_tokens == want


def test_vllm_stream_ends_with_done(one):
    """A vLLM stream ends with `data: [DONE]`; one without it is cut, an error row. Source:
    vllm/entrypoints/openai/completion/serving.py (completion_stream_generator)."""
    c = one(routes_for("vllm"), "FAULT:nodone", True)
    assert c["rec"].status == "error" and "[DONE]" in c["rec"].error


def test_vllm_error_object_above_max_logprobs(one):
    """More top-k than --max-logprobs (default 20) is a 400 with an error object naming the
    limit, never a capped answer. Source: vllm/sampling_params.py (_validate_logprobs),
    vllm/config/model.py (max_logprobs = 20), vllm/entrypoints/serve/exception_handling/
    error_response.py (BadRequestError)."""
    routes = routes_with("vllm", False, "vllm__v1-completions__error-max-logprobs.http")
    c = one(routes, PROMPT, False)
    rec = c["rec"]
    assert rec.status == "error" and rec.http_status == 400 and "max allowed: 20" in rec.error
    assert c["s"].counts["error"] == 1
