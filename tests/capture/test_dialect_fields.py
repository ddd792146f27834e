"""One test per field each dialect reads, checked against the shapes in the engines' own source.

The vLLM, SGLang and TGI transcripts are constructed from the response models of vLLM 0.33.0,
SGLang 0.5.23 and TGI v3.3.7 (fixtures/transcripts/README.md, "Constructed transcripts", cites
repository, file and commit); the llama.cpp ones are recordings of llama.cpp 0c1e570, whose
source is cited the same way. Every docstring names the source file a field was read from. A
field is checked through the real capture client against the replay server (a real socket,
random chunking), or, where the test must change one value the engine can send (a sampled
token, a tie, another finish reason), through the dialect's own parse function.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from capture_helpers import write_prompts
from replay import ReplayServer, load, routes_for

from capture.capture_run import CaptureConfig, run_capture
from capture.dialects import Acc, RequestSpec, get
from capture.sse import SSEDecoder
from tracekit.errors import ConfigError, ResponseShapeError
from tracekit.store import TraceReader

# The 12 greedy tokens, top-5, that every transcript carries (llama-server's recording).
_SRC = json.loads(load("llamacpp-server__completion__nonstream.http").body)["completion_probabilities"]
IDS = [e["id"] for e in _SRC]
LPS = np.array([e["logprob"] for e in _SRC], np.float32)
TOP_IDS = np.array([[t["id"] for t in e["top_logprobs"]] for e in _SRC], np.int32)
TOP_LPS = np.array([[t["logprob"] for t in e["top_logprobs"]] for e in _SRC], np.float32)
PROMPT = "def parse_args(argv):\n    "
PROMPT_IDS = [317, 659, 262, 64, 512, 9, 2044, 304, 200, 259]

ROUTE = {"vllm": "/v1/completions", "sglang": "/generate", "llamacpp": "/completion"}
VARIANTS = {  # name: (engine, stream, the transcript that replaces the engine's default for that mode)
    "vllm-stream": ("vllm", True, None),
    "vllm-nonstream": ("vllm", False, None),
    "vllm-nonstream-cached": ("vllm", False, "vllm__v1-completions__nonstream-cached.http"),
    "sglang-stream": ("sglang", True, None),
    "sglang-stream-incremental": ("sglang", True, "sglang__generate__stream-incremental.http"),
    "sglang-nonstream": ("sglang", False, None),
    "tgi-stream": ("tgi", True, None),
    "tgi-nonstream": ("tgi", False, None),
    "llamacpp-stream": ("llamacpp", True, None),
    "llamacpp-nonstream": ("llamacpp", False, None),
}


def _routes(engine: str, stream: bool, name: str | None) -> dict:
    routes = routes_for(engine)
    if name is not None:
        key = ("POST", ROUTE[engine])
        routes[key] = {**routes[key], "stream" if stream else "nonstream": load(name)}
    return routes


def _capture(out: Path, routes: dict, prompt, stream: bool, top_logprobs: int = 5) -> dict:
    """One request through the real capture client (dialect auto): its summary, row, columns and
    the POST bodies the server saw."""
    prompts = write_prompts(out.with_suffix(".jsonl"), [{"id": "a", "prompt": prompt}])
    with ReplayServer(routes) as srv:
        cfg = CaptureConfig(
            srv.url, prompts, str(out), stream=stream, max_tokens=12, top_logprobs=top_logprobs, progress=False
        )
        s = run_capture(cfg)
        sent = list(srv.requests)
    with TraceReader(out) as r:
        pids = r.prompt_ids(0)
        return {
            "s": s,
            "rec": r.record(0),
            "tok": r.tokens(0),
            "run": r.meta.run,
            "sent": sent,
            "pids": None if pids is None else pids.tolist(),
        }


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """captured(variant) -> the capture of VARIANTS[variant], made once per module."""
    cache: dict = {}
    base = tmp_path_factory.mktemp("fields")

    def get_(variant: str) -> dict:
        if variant not in cache:
            engine, stream, name = VARIANTS[variant]
            prompt = PROMPT_IDS if engine == "llamacpp" else PROMPT
            cache[variant] = _capture(base / f"{variant}.h5", _routes(engine, stream, name), prompt, stream)
        return cache[variant]

    return get_


@pytest.fixture
def one(tmp_path):
    """one(routes, prompt, stream, **options): a capture that is not shared."""
    return lambda routes, prompt, stream, **kw: _capture(tmp_path / "one.h5", routes, prompt, stream, **kw)


def _parse(dialect: str, objs: list, k: int = 5):
    """The dialect's own parse of these JSON objects (stream events or one body) -> (acc, columns)."""
    d, acc = get(dialect), Acc()
    for obj in objs:
        d.parse_event(obj, acc, 1.0)
    return acc, acc.columns(k, False, None)


def _events(name: str) -> list:
    return [json.loads(ev.data) for ev in SSEDecoder().feed(load(name).body) if ev.data != "[DONE]"]


def _body(name: str):
    return json.loads(load(name).body)


# ---- vLLM 0.33.0: /v1/completions with return_tokens_as_token_ids, return_token_ids ---------
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
    events = _events("vllm__v1-completions__stream.http")
    for ev in events:
        for ch in ev["choices"]:
            del ch["token_ids"]
    acc, cols = _parse("vllm", events)
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
    body = _body("vllm__v1-completions__nonstream.http")
    ch, lp = body["choices"][0], body["choices"][0]["logprobs"]
    keys = [f"token_id:{i}" for i in TOP_IDS[0]]
    second = keys[1]  # position 0 sampled the 2nd candidate: it comes first, the dict has k entries
    lp["top_logprobs"][0] = {second: lp["top_logprobs"][0][second], **lp["top_logprobs"][0]}
    lp["tokens"][0], lp["token_logprobs"][0], ch["token_ids"][0] = second, float(TOP_LPS[0, 1]), int(TOP_IDS[0, 1])
    # position 1 sampled a token outside the top-k: first, then the k others (k + 1 entries)
    lp["top_logprobs"][1] = {"token_id:1999": -9.0, **lp["top_logprobs"][1]}
    lp["tokens"][1], lp["token_logprobs"][1], ch["token_ids"][1] = "token_id:1999", -9.0, 1999
    assert list(lp["top_logprobs"][0]) != keys and len(lp["top_logprobs"][1]) == 6
    _, cols = _parse("vllm", [body])
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
        nulls = [ev["choices"][0]["prompt_token_ids"] for ev in _events("vllm__v1-completions__stream.http")[1:-1]]
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
    routes = _routes("vllm", False, "vllm__v1-completions__error-max-logprobs.http")
    c = one(routes, PROMPT, False)
    rec = c["rec"]
    assert rec.status == "error" and rec.http_status == 400 and "max allowed: 20" in rec.error
    assert c["s"].counts["error"] == 1


# ---- SGLang 0.5.23: native /generate --------------------------------------------------------
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
    body = _body("sglang__generate__nonstream.http")
    body["meta_info"]["output_top_logprobs"][3] = None
    _, cols = _parse("sglang", [body])
    assert cols.token_id.tolist() == IDS and (cols.topk_id[3] == -1).all() and np.isnan(cols.topk_logprob[3]).all()
    np.testing.assert_array_equal(np.delete(cols.topk_id, 3, 0), np.delete(TOP_IDS, 3, 0))


def test_sglang_completion_tokens_tells_cumulative_from_incremental():
    """`meta_info.completion_tokens` is cumulative in both modes; the logprob lists are cumulative
    by default and only the new entries with --incremental-streaming-output. The dialect takes
    only what it has not seen. Source: sglang/srt/managers/tokenizer_manager.py
    (_INCREMENTAL_STREAMING_META_INFO_KEYS, _slice_streaming_output_meta_info)."""
    for name, entries in (("sglang__generate__stream.http", 78), ("sglang__generate__stream-incremental.http", 12)):
        events = _events(name)
        assert sum(len(ev["meta_info"]["output_token_logprobs"]) for ev in events) == entries
        assert [ev["meta_info"]["completion_tokens"] for ev in events] == list(range(1, 13))
        _, cols = _parse("sglang", events)
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
    from capture.client import _TOKENIZE

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
    c = _capture(tmp_path / "r.h5", {**routes_for("sglang"), **extra}, PROMPT, False)
    assert c["run"]["dtype"] == "bf16" and c["run"]["dtype_source"] == source


def test_sglang_found_by_model_info(tmp_path):
    """Without `owned_by: sglang` (a proxy in front of it), SGLang is found by `/model_info`, or
    `/get_model_info`, its deprecated alias. Source: sglang/srt/entrypoints/http_server.py
    (get_model_info -> model_info, "model_path")."""
    models = load("sglang__v1-models.http")
    other = dataclasses.replace(models, body=models.body.replace(b'"owned_by":"sglang"', b'"owned_by":"proxy"'))
    info = _json_route({"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True})
    routes = {**routes_for("sglang"), ("GET", "/v1/models"): other, ("GET", "/model_info"): info}
    c = _capture(tmp_path / "r.h5", routes, PROMPT, True)
    assert c["run"]["dialect"] == "sglang" and c["run"]["dialect_reason"] == "/model_info answered (SGLang)"
    assert c["run"]["engine_family"] == "sglang" and c["rec"].status == "ok"


@pytest.mark.parametrize("variant", SGLANG)
def test_sglang_finish_reason(captured, variant):
    """`meta_info.finish_reason` is an object whose `type` is the reason: `{"type": "length",
    "length": N}`, `{"type": "stop", "matched": id}` for a stop token (EOS included), null until
    the end. Source: sglang/srt/managers/schedule_batch.py (FINISH_LENGTH, FINISH_MATCHED_TOKEN)."""
    assert captured(variant)["rec"].finish_reason == "length"
    body = _body("sglang__generate__nonstream.http")
    body["meta_info"]["finish_reason"] = {"type": "stop", "matched": 0}
    acc, _ = _parse("sglang", [body])
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


# ---- TGI v3.3.7: /generate, /generate_stream ------------------------------------------------
TGI = ["tgi-stream", "tgi-nonstream"]


@pytest.mark.parametrize("variant", TGI)
def test_tgi_token_id_and_logprob(captured, variant):
    """`details.tokens[].{id, logprob}` (non-stream) and each event's `token.{id, logprob}`.
    Source: router/src/lib.rs (Token {id, text, logprob, special}, Details, StreamResponse)."""
    tok = captured(variant)["tok"]
    assert captured(variant)["s"].dialect == "tgi" and tok.token_id.tolist() == IDS
    np.testing.assert_array_equal(tok.logprob, LPS)


@pytest.mark.parametrize("variant", TGI)
def test_tgi_top_tokens(captured, variant):
    """`details.top_tokens[][]` (non-stream) and each event's `top_tokens[]` give the top-k.
    Source: router/src/lib.rs (Details.top_tokens, StreamResponse.top_tokens: skipped when empty)."""
    tok = captured(variant)["tok"]
    np.testing.assert_array_equal(tok.topk_id, TOP_IDS)
    np.testing.assert_array_equal(tok.topk_logprob, TOP_LPS)


def test_tgi_top_tokens_with_ties_beyond_n():
    """TGI returns every token tied with the n-th, so a row can hold more than top_n_tokens: the
    trace keeps the first k in rank order. Source: server/text_generation_server/utils/tokens.py
    (batch_top_tokens: "When multiple tokens have equal probabilities and they don't all fit, the
    remaining tokens are also returned"). The tied extra token is made up."""
    events = _events("tgi__generate_stream__stream.http")
    events[0]["top_tokens"].append(dict(events[0]["top_tokens"][-1], id=1999))  # tied with the 5th
    _, cols = _parse("tgi", events)
    assert len(events[0]["top_tokens"]) == 6 and cols.topk_id.shape == (12, 5)
    np.testing.assert_array_equal(cols.topk_id, TOP_IDS)  # ties keep the engine's order
    np.testing.assert_array_equal(cols.topk_logprob, TOP_LPS)


@pytest.mark.parametrize("variant", TGI)
def test_tgi_finish_reason(captured, variant):
    """`details.finish_reason` is `length`, `eos_token` or `stop_sequence`; the trace says `length`
    or `stop`. Source: router/src/lib.rs (FinishReason, serde names)."""
    assert captured(variant)["rec"].finish_reason == "length"
    for tgi_name, want in (("eos_token", "stop"), ("stop_sequence", "stop"), ("length", "length")):
        body = _body("tgi__generate__nonstream.http")
        body["details"]["finish_reason"] = tgi_name
        acc = Acc()
        get("tgi").parse_response(body, acc, 1.0)
        assert acc.finish_reason == want


def test_tgi_stream_ends_with_the_details_event(one):
    """/generate_stream sends no `[DONE]`: the event with `details` is the last; a stream without
    it is cut, an error row. Source: router/src/server.rs (generate_stream_internal:
    InferStreamResponse::End carries details; IncompleteGenerationStream otherwise)."""
    c = one(routes_for("tgi"), "FAULT:nodone", True)
    assert c["rec"].status == "error" and "final event" in c["rec"].error


@pytest.mark.parametrize("variant", TGI)
def test_tgi_reports_no_cached_tokens(captured, variant):
    """TGI's answers have no cached-token count at all (prefix caching is internal to the v3
    backend): -1, unknown. Source: router/src/lib.rs (Details, StreamDetails: no such field),
    backends/v3/src/queue.rs (prefix_len stays inside the router)."""
    assert captured(variant)["rec"].cached_tokens == -1


def test_tgi_top_n_tokens_above_its_limit_stops_the_capture(tmp_path):
    """TGI refuses top_n_tokens above --max-top-n-tokens (default 5) with a 422 and never caps it,
    and /info does not say the limit: the capture asks once with an empty input (refused after
    the top_n check, so nothing is generated) and stops before any file exists, naming
    --top-logprobs. Source: router/src/validation.rs (TopNTokens, checked before EmptyInput),
    launcher/src/main.rs (max_top_n_tokens default 5), router/src/lib.rs (Info)."""
    routes = {**routes_for("tgi"), ("POST", "/generate"): load("tgi__generate__error-top-n-tokens.http")}
    with pytest.raises(ConfigError) as e:
        _capture(tmp_path / "r.h5", routes, PROMPT, True, top_logprobs=20)
    assert "--top-logprobs 5 or less" in str(e.value) and "--max-top-n-tokens 20" in str(e.value)
    assert not (tmp_path / "r.h5").exists()


def test_tgi_top_n_tokens_refused_inside_a_stream(one):
    """On /generate_stream the same refusal is HTTP 200 and one error event: an error row with
    TGI's words, never a success with no tokens. Source: router/src/server.rs
    (generate_stream_internal yields Err(err); From<InferError> for Event), router/src/infer/mod.rs
    ("Input validation error: {0}")."""
    routes = {**routes_for("tgi"), ("POST", "/generate_stream"): load("tgi__generate_stream__error-top-n-tokens.http")}
    c = one(routes, PROMPT, True)
    rec = c["rec"]
    assert rec.status == "error" and rec.http_status == 200 and "`top_n_tokens` must be >= 0 and <= 5" in rec.error
    # the top-n question, the prompt's ids from /tokenize, then the request
    assert [q["path"] for q in c["sent"]] == ["/generate", "/tokenize", "/generate_stream"]
    assert c["sent"][0]["body"]["inputs"] == ""


def test_tgi_info_fields(captured):
    """/info has neither model_dtype (commented out since v2.3.0) nor max_top_n_tokens: the run
    records what it has, and the top-n limit is asked with a request. Source: router/src/lib.rs
    (Info)."""
    info = captured("tgi-stream")["run"]["engine"]["info"]
    assert set(info) == {"model_id", "version", "router", "sha"} and info["version"] == "3.3.6-dev0"
    assert "max_top_n_tokens" not in json.loads(load("tgi__info.http").body)


def test_tgi_has_no_ignore_eos(tmp_path, capsys):
    """TGI takes no ignore_eos: the router builds every request's stopping parameters with
    `ignore_eos_token: false` (only its warmup and benchmark set true), so a capture that asks to
    ignore EOS says once that TGI stops at the first EOS. Source: router/src/validation.rs
    (StoppingCriteriaParameters), backends/client/src/v3/client.rs (warmup)."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": PROMPT}])
    for ignore, said in ((True, 1), (False, 0)):
        with ReplayServer(routes_for("tgi")) as srv:
            cfg = CaptureConfig(srv.url, prompts, str(tmp_path / f"{ignore}.h5"), ignore_eos=ignore, progress=False)
            run_capture(cfg)
        body = srv.requests[-1]["body"]
        assert "ignore_eos" not in json.dumps(body)  # nothing TGI would read
        err = capsys.readouterr().err
        assert err.count("warning: TGI has no ignore_eos switch") == said
        with TraceReader(tmp_path / f"{ignore}.h5") as r:
            assert ("tgi_no_ignore_eos" in {p["code"] for p in r.meta.run["pitfalls"]}) is ignore


def test_tgi_tokenize_shape():
    """POST /tokenize takes a GenerateRequest `{inputs}` and answers a JSON list of `{id, text,
    start, stop}`; tracekit reads the ids. add_special_tokens is no request field (serde skip,
    default true), so the ids are those /generate runs. Source: router/src/server.rs (tokenize,
    encoding_to_tokens), router/src/lib.rs (SimpleToken, TokenizeResponse, GenerateRequest)."""
    from capture.client import _TOKENIZE

    route, body, ids_of = _TOKENIZE["tgi"]
    t = load("tgi__tokenize.http")
    assert route == t.path and body(PROMPT) == json.loads(t.request)
    answer = json.loads(t.body)
    assert ids_of(answer) == PROMPT_IDS and "".join(x["text"] for x in answer) == PROMPT


@pytest.mark.parametrize("stream", [True, False])
def test_tgi_request_is_greedy_without_temperature(stream):
    """TGI refuses temperature <= 0 and decoder_input_details on a stream: the dialect asks greedy
    with `do_sample: false`, no temperature, and never asks prefill details. Source:
    router/src/validation.rs (Temperature, PrefillDetailsStream), router/src/lib.rs
    (GenerateParameters)."""
    body = get("tgi").body(RequestSpec("a", PROMPT, 12, 5, False, stream))
    p = body["parameters"]
    assert "temperature" not in p and p["do_sample"] is False and p["decoder_input_details"] is False
    assert p["details"] is True and p["top_n_tokens"] == 5 and body["inputs"] == PROMPT


# ---- llama.cpp 0c1e570: native /completion (recorded) ---------------------------------------
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
        obj = _body("llamacpp-server__completion__nonstream.http")
        obj["stop_type"] = name
        acc, _ = _parse("llamacpp", [obj])
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
    obj = _body("llamacpp-server__completion__nonstream.http")
    for e in obj["completion_probabilities"]:
        e["prob"] = float(np.exp(e.pop("logprob")))
        e["top_probs"] = [{"id": t["id"], "prob": float(np.exp(t["logprob"]))} for t in e.pop("top_logprobs")]
    with pytest.raises(ResponseShapeError):
        _parse("llamacpp", [obj])
