"""One test per field the tgi dialect reads: TGI v3.3.7, /generate, /generate_stream, /info and
/tokenize. Its transcripts are constructed from the response models of TGI's source
(fixtures/transcripts/README.md cites repository, file and commit); every docstring names the
source file a field was read from. Shared setup: dialect_fields_shared.py; the
`captured` and `one` fixtures: conftest.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.capture_helpers import write_prompts
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
from support.replay import ReplayServer, load, routes_for

from tracekit.capture.dialects import Acc, RequestSpec, get
from tracekit.capture.http import CaptureConfig, run_capture
from tracekit.errors import ConfigError
from tracekit.store import TraceReader

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
    events = events_of("tgi__generate_stream__stream.http")
    events[0]["top_tokens"].append(dict(events[0]["top_tokens"][-1], id=1999))  # tied with the 5th
    _, cols = parse_with("tgi", events)
    assert len(events[0]["top_tokens"]) == 6 and cols.topk_id.shape == (12, 5)
    np.testing.assert_array_equal(cols.topk_id, TOP_IDS)  # ties keep the engine's order
    np.testing.assert_array_equal(cols.topk_logprob, TOP_LPS)


@pytest.mark.parametrize("variant", TGI)
def test_tgi_finish_reason(captured, variant):
    """`details.finish_reason` is `length`, `eos_token` or `stop_sequence`; the trace says `length`
    or `stop`. Source: router/src/lib.rs (FinishReason, serde names)."""
    assert captured(variant)["rec"].finish_reason == "length"
    for tgi_name, want in (("eos_token", "stop"), ("stop_sequence", "stop"), ("length", "length")):
        body = body_of("tgi__generate__nonstream.http")
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
        capture_one(tmp_path / "r.h5", routes, PROMPT, True, top_logprobs=20)
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
    from tracekit.capture.client import _TOKENIZE

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
