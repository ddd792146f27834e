"""Each pitfall of issue 13 is warned at capture (one `warning:` line on stderr, once a run) and
recorded in the run metadata's `pitfalls` ([{code, message}]) for the reports, and is silent
where the engine gives the evidence. Real sockets: the replay server with the transcripts of
fixtures/transcripts/; the reference engine's clean run is in test_engine_e2e.py."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from support.capture_helpers import TOKENIZER
from support.replay import ReplayServer, load, routes_for
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from tracekit.store import TraceReader

_RUNS = itertools.count()
X = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "c", "prompt": "z"}]


def _capture(capture_to, capsys, engine: str, prompts=X, **kw) -> tuple[dict, list[str]]:
    """({code: message} recorded in the run metadata, the warning lines on stderr)."""
    with ReplayServer(routes_for(engine)) as srv:
        _, out = capture_to(srv.url, prompts, name=f"run{next(_RUNS)}.h5", **kw)
    with TraceReader(out) as r:
        found = {p["code"]: p["message"] for p in r.meta.run["pitfalls"]}
    return found, [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]


def _said_once(found: dict, warnings: list[str], code: str) -> str:
    assert code in found, found
    assert warnings.count(f"warning: {found[code]}") == 1, warnings
    return found[code]


def test_no_per_request_cached_tokens_after_the_first_answers(capture_to, capsys):
    """vLLM without --enable-prompt-tokens-details (the non-stream transcript has no
    prompt_tokens_details): said after the first 3 ok answers, with the flag that fixes it."""
    found, warns = _capture(capture_to, capsys, "vllm", stream=False, tokenizer=TOKENIZER)
    msg = _said_once(found, warns, "no_cached_tokens")
    assert "--enable-prompt-tokens-details" in msg and "cache_boundary never applies" in msg
    # The streamed transcript reports them (8): no warning.
    found, _ = _capture(capture_to, capsys, "vllm", tokenizer=TOKENIZER)
    assert "no_cached_tokens" not in found


def test_a_single_request_run_is_judged_at_its_end(capture_to, capsys):
    found, warns = _capture(capture_to, capsys, "tgi", prompts=X[:1], tokenizer=TOKENIZER)
    assert "TGI does not report them" in _said_once(found, warns, "no_cached_tokens")


@pytest.mark.parametrize(
    "prompts,shown",
    [
        ([{"id": "a", "prompt": "x", "temperature": 0.7}, *X[1:]], "1 of 3 requests are not greedy (temperature 0.7)"),
        ([{"id": "a", "prompt": "x", "extra": {"top_p": 0.9}}, *X[1:]], "(top_p 0.9)"),
        (
            [{"id": "a", "prompt": "x", "extra": {"repetition_penalty": 1.1, "presence_penalty": 0}}],
            "(repetition_penalty 1.1)",
        ),
    ],
)
def test_requests_that_are_not_greedy(capture_to, capsys, prompts, shown):
    found, warns = _capture(capture_to, capsys, "vllm", prompts=prompts, tokenizer=TOKENIZER)
    assert shown in _said_once(found, warns, "not_greedy")


def test_greedy_requests_with_neutral_fields_are_not_warned(capture_to, capsys):
    prompts = [{"id": "a", "prompt": "x", "extra": {"top_p": 1.0, "presence_penalty": 0, "top_k": 40}}]
    found, _ = _capture(capture_to, capsys, "vllm", prompts=prompts, tokenizer=TOKENIZER)
    assert "not_greedy" not in found


def test_vllm_refuses_a_top_k_above_its_max_logprobs(capture_to, capsys):
    """What vLLM really does with more top-k than --max-logprobs (default 20): it checks `logprobs`
    before generating and answers 400 ("Requested sample logprobs of 21, which is greater than max
    allowed: 20"), never fewer candidates (vllm/sampling_params.py _validate_logprobs, vLLM 0.33.0).
    Every row is an error with its words; nothing was capped, so no topk_capped."""
    refused = load("vllm__v1-completions__error-max-logprobs.http")
    routes = {**routes_for("vllm"), ("POST", "/v1/completions"): refused}
    with ReplayServer(routes) as srv:
        s, out = capture_to(srv.url, X, top_logprobs=21, tokenizer=TOKENIZER)
    assert s.counts["error"] == 3 and s.counts["ok"] == 0
    with TraceReader(out) as r:
        recs = [r.record(i) for i in range(len(r))]
        assert "topk_capped" not in {p["code"] for p in r.meta.run["pitfalls"]}
    assert all(x.http_status == 400 and "greater than max allowed: 20" in x.error for x in recs)
    assert not any("top-k" in w for w in capsys.readouterr().err.splitlines())


def test_a_server_that_caps_top_k_silently(capture_to, capsys):
    """8 asked, 5 sent, status 200: a server that caps without saying so (neither vLLM nor TGI:
    they refuse, above). An OpenAI-shaped server of unknown make, replayed from the vLLM-shaped
    answer with its self-report removed."""
    models = load("vllm__v1-models.http")
    acme = replace(models, body=models.body.replace(b'"owned_by":"vllm"', b'"owned_by":"acme"'))
    routes = {**routes_for("vllm"), ("GET", "/v1/models"): acme}
    with ReplayServer(routes) as srv:
        _, out = capture_to(srv.url, X, top_logprobs=8, dialect="openai", tokenizer=TOKENIZER)
    with TraceReader(out) as r:
        found = {p["code"]: p["message"] for p in r.meta.run["pitfalls"]}
    warns = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert "at most 5 top-k candidates a token where 8 were asked" in _said_once(found, warns, "topk_capped")
    found, _ = _capture(capture_to, capsys, "vllm", top_logprobs=5, tokenizer=TOKENIZER)
    assert "topk_capped" not in found


def test_logprobs_mode_processed_or_unknown(capture_to, capsys):
    found, warns = _capture(capture_to, capsys, "vllm", logprobs_mode="processed_logprobs", tokenizer=TOKENIZER)
    assert "--logprobs-mode raw_logprobs" in _said_once(found, warns, "logprobs_processed")
    found, warns = _capture(capture_to, capsys, "vllm", tokenizer=TOKENIZER)  # vLLM does not say
    assert "VLLM_SERVER_DEV_MODE=1" in _said_once(found, warns, "logprobs_mode_unknown")
    found, _ = _capture(capture_to, capsys, "vllm", logprobs_mode="raw_logprobs", tokenizer=TOKENIZER)
    assert not {"logprobs_processed", "logprobs_mode_unknown"} & set(found)


def test_tgi_prefill_logprobs(capture_to, capsys):
    found, warns = _capture(capture_to, capsys, "tgi", tokenizer=TOKENIZER)
    msg = _said_once(found, warns, "tgi_prefill_logprobs")
    assert "--enable-prefill-logprobs" in msg and "the engine's /tokenize" in msg


def test_eos_ids_unknown(capture_to, capsys):
    found, warns = _capture(capture_to, capsys, "vllm")
    assert "post_eos" in _said_once(found, warns, "eos_unknown")
    found, _ = _capture(capture_to, capsys, "vllm", tokenizer=TOKENIZER)  # its files say EOS 0
    assert "eos_unknown" not in found


def test_a_tokenizer_that_does_not_round_trip_the_engine_strings(capture_to, capsys, tmp_path):
    """llama-cpp-python sends token strings only; a tokenizer of another vocabulary maps none."""
    other = tmp_path / "other"
    other.mkdir()
    Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(str(other / "tokenizer.json"))
    (other / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    found, warns = _capture(capture_to, capsys, "llama-cpp-python", tokenizer=str(other))
    assert f"not in the vocabulary of {other}" in _said_once(found, warns, "tokenizer_mismatch")
    found, warns = _capture(capture_to, capsys, "llama-cpp-python")  # no tokenizer at all
    assert "pass --tokenizer DIR" in _said_once(found, warns, "token_ids_unknown")
    found, _ = _capture(capture_to, capsys, "llama-cpp-python", tokenizer=TOKENIZER)  # the served model's
    assert not {"tokenizer_mismatch", "token_ids_unknown"} & set(found)
