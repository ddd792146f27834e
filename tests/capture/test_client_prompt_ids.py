"""Prompt token ids of text prompts from SGLang and TGI themselves, through the real capture client
on the replay server (real sockets).

Why it matters: `tracekit diff` calls a pair incomparable when the prompt tokens differ, and the
teacher-forced diagnostic replays exactly these ids. A local tokenizer may split a text otherwise
than the engine did; the engine's own ids are the ones it ran. Shapes from the engines' source
(fixtures/transcripts/README.md): SGLang 0.5.23 echoes them with `return_prompt_token_ids`
(sglang/srt/managers/tokenizer_manager.py) and has `POST /tokenize {prompt, add_special_tokens}`
-> `{tokens, count, max_model_len}` (sglang/srt/entrypoints/openai/serving_tokenize.py); TGI
v3.3.7 has `POST /tokenize {inputs}` -> `[{id, text, start, stop}]` (router/src/server.rs).

The replayed /tokenize answers below are changed to ids no tokenizer gives for the prompt
(ENGINE_IDS), so every test sees which source a row's ids came from.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from support.capture_helpers import TOKENIZER
from support.replay import ReplayServer, load, routes_for

from tracekit.cli.inspect import cmd as inspect_cmd
from tracekit.store import TraceReader

PROMPT = "def parse_args(argv):\n    "
PROMPT_IDS = [317, 659, 262, 64, 512, 9, 2044, 304, 200, 259]  # the fixture tokenizer's, and the echo's
ENGINE_IDS = [7, 8, 9]  # what the changed /tokenize answers say
ECHO = b',"prompt_token_ids":[317,659,262,64,512,9,2044,304,200,259]'


def _with_body(name: str, body) -> object:
    return dataclasses.replace(load(name), body=json.dumps(body).encode())


def _tokenize(engine: str):
    if engine == "sglang":
        return _with_body("sglang__tokenize.http", {"tokens": ENGINE_IDS, "count": 3, "max_model_len": 1024})
    return _with_body("tgi__tokenize.http", [{"id": i, "text": "x", "start": 0, "stop": 1} for i in ENGINE_IDS])


def _no_echo(routes: dict) -> dict:
    """An SGLang whose /generate does not know return_prompt_token_ids (it ignores the key)."""
    gen = routes[("POST", "/generate")]
    return {
        **routes,
        ("POST", "/generate"): {k: dataclasses.replace(t, body=t.body.replace(ECHO, b"")) for k, t in gen.items()},
    }


def _run(capture_to, routes: dict, **kw) -> tuple[dict, list[list[int] | None], list[dict]]:
    """(run metadata, each row's prompt ids, the POSTs the server saw)."""
    with ReplayServer(routes) as srv:
        _, out = capture_to(srv.url, [{"id": "a", "prompt": PROMPT}, {"id": "b", "prompt": PROMPT}], **kw)
        sent = list(srv.requests)
    with TraceReader(out) as r:
        ids = [None if r.prompt_ids(i) is None else r.prompt_ids(i).tolist() for i in range(len(r))]
        assert [r.record(i).status for i in range(len(r))] == ["ok", "ok"]
        return r.meta.run, ids, sent


@pytest.mark.parametrize("stream", [True, False])
def test_sglang_prompt_ids_come_from_its_answer(capture_to, stream):
    """A text prompt asks `return_prompt_token_ids`; the ids SGLang echoes (every stream event
    carries them) are stored, whatever its /tokenize or the local tokenizer would say."""
    routes = {**routes_for("sglang"), ("POST", "/tokenize"): _tokenize("sglang")}
    run, ids, sent = _run(capture_to, routes, stream=stream, tokenizer=TOKENIZER)
    assert ids == [PROMPT_IDS, PROMPT_IDS]
    assert run["prompt_ids"].startswith("the response's prompt_token_ids (SGLang's return_prompt_token_ids)")
    gens = [q["body"] for q in sent if q["path"] == "/generate"]
    assert len(gens) == 2 and all(b["return_prompt_token_ids"] is True and b["text"] == PROMPT for b in gens)
    assert run["engine_family"] == "sglang"


def test_sglang_token_id_prompts_do_not_ask_for_their_ids():
    from tracekit.capture.dialects import RequestSpec, get

    body = get("sglang").body(RequestSpec("a", PROMPT_IDS, 12, 5, False, True))
    assert body["input_ids"] == PROMPT_IDS and "return_prompt_token_ids" not in body and "text" not in body


@pytest.mark.parametrize("stream", [True, False])
def test_sglang_without_the_echo_takes_its_tokenize(capture_to, stream):
    """An SGLang that does not echo: the ids of its own POST /tokenize (asked once per distinct
    text, before the run, with add_special_tokens as /generate encodes), never the local tokenizer."""
    routes = _no_echo({**routes_for("sglang"), ("POST", "/tokenize"): _tokenize("sglang")})
    run, ids, sent = _run(capture_to, routes, stream=stream, tokenizer=TOKENIZER)
    assert ids == [ENGINE_IDS, ENGINE_IDS]
    asked = [q["body"] for q in sent if q["path"] == "/tokenize"]
    assert asked == [{"prompt": PROMPT, "add_special_tokens": True}]  # one distinct text, asked once
    assert "where an answer lacks them, the engine's /tokenize (the ids it runs)" in run["prompt_ids"]


@pytest.mark.parametrize("stream", [True, False])
def test_tgi_prompt_ids_come_from_its_tokenize(capture_to, stream):
    """TGI never echoes prompt ids (prefill logprobs are off by default): POST /tokenize {inputs}
    answers TGI's own ids, which are stored; the run metadata names the route, and `tracekit
    inspect` shows it."""
    routes = {**routes_for("tgi"), ("POST", "/tokenize"): _tokenize("tgi")}
    run, ids, sent = _run(capture_to, routes, stream=stream, tokenizer=TOKENIZER)
    assert ids == [ENGINE_IDS, ENGINE_IDS]
    assert [q["body"] for q in sent if q["path"] == "/tokenize"] == [{"inputs": PROMPT}]
    assert run["prompt_ids"] == "the engine's /tokenize (the ids it runs), for text prompts it does not echo"
    assert run["engine_family"] == "tgi"  # not its /v1/models owned_by, which is the model id


def test_inspect_shows_where_prompt_ids_came_from(capture_to, tmp_path):
    routes = {**routes_for("tgi"), ("POST", "/tokenize"): _tokenize("tgi")}
    with ReplayServer(routes) as srv:
        _, out = capture_to(srv.url, [{"id": "a", "prompt": PROMPT}], dialect="tgi")
    res = CliRunner().invoke(inspect_cmd, [str(out)])
    assert res.exit_code == 0, res.output
    assert "prompt_ids: the engine's /tokenize (the ids it runs)" in res.output
    assert "engine_family: tgi" in res.output and "prompt tokens: 3" in res.output


def _failing(engine: str, how: str) -> dict:
    routes = routes_for(engine)
    if how == "absent":  # an engine without the route, or TGI without a fast tokenizer: 404
        del routes[("POST", "/tokenize")]
    elif how == "no ids":  # 200 with a body that holds no list of ids
        routes[("POST", "/tokenize")] = _with_body(f"{engine}__tokenize.http", {"detail": "nothing"})
    return _no_echo(routes) if engine == "sglang" else routes


@pytest.mark.parametrize("engine", ["sglang", "tgi"])
@pytest.mark.parametrize("how,said", [("absent", "answered HTTP 404"), ("no ids", "answered without ids")])
def test_a_failing_tokenize_falls_back_to_the_tokenizer(capture_to, engine, how, said):
    run, ids, _ = _run(capture_to, _failing(engine, how), dialect=engine, tokenizer=TOKENIZER)
    assert ids == [PROMPT_IDS, PROMPT_IDS]
    assert f"the local tokenizer {TOKENIZER} (may differ from the engine's)" in run["prompt_ids"]
    assert f"(the engine's /tokenize {said})" in run["prompt_ids"]


@pytest.mark.parametrize("engine", ["sglang", "tgi"])
def test_without_a_tokenizer_the_ids_stay_unknown(capture_to, engine):
    run, ids, _ = _run(capture_to, _failing(engine, "absent"), dialect=engine)
    assert ids == [None, None]
    assert "unknown for text prompts" in run["prompt_ids"] and "answered HTTP 404" in run["prompt_ids"]
