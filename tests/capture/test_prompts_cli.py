"""Prompt-file validation, token-string mapping and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.capture_helpers import TOKENIZER, write_prompts
from support.replay import ReplayServer, routes_for

from tracekit.capture.prompts import load_prompts
from tracekit.capture.tokens import TokenMapper
from tracekit.errors import ConfigError
from tracekit.modelinfo import eos_token_ids
from tracekit.store import TraceReader

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "line,msg",
    [
        ('{"prompt": "x"}', "'id' must be a non-empty string"),
        ('{"id": "a#1", "prompt": "x"}', "marks repeats"),
        ('{"id": "a", "prompt": []}', "list must hold non-negative token ids"),
        ('{"id": "a", "prompt": 3}', "non-empty string or a list"),
        ('{"id": "a", "prompt": "x", "max_token": 3}', "unknown field(s) ['max_token']"),
        ('{"id": "a", "prompt": "x", "max_tokens": true}', "'max_tokens' has the wrong type"),
        ('{"id": "a", "prompt": "x"', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "a", "prompt": "x \\ud800 y"}', "'prompt' holds a lone surrogate escape"),
        ('{"id": "\\udc00", "prompt": "x"}', "'id' holds a lone surrogate escape"),
    ],
)
def test_bad_prompt_lines_are_one_line_errors_with_the_line_number(tmp_path, line, msg):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "prompt": "x"}\n' + line + "\n")
    with pytest.raises(ConfigError) as e:
        load_prompts(p)
    assert msg in str(e.value) and f"{p}:2" in str(e.value)


def test_duplicates_and_empty_sets(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="duplicate id 'a'"):
        load_prompts(p)
    p.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_prompts(p)


def test_overrides_and_extra(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        json.dumps({"id": "a", "prompt": [1, 2], "max_tokens": 4, "extra": {"seed": 3}, "meta": {"n": 2}}) + "\n"
    )
    (a,) = load_prompts(p)
    assert a.prompt == [1, 2] and a.overrides == {"max_tokens": 4} and a.extra == {"seed": 3}


def test_token_strings_map_through_byte_level_bpe():
    """Engines send decoded text (" if", "\\n"); the vocab stores "Ġif", "Ċ"."""
    m = TokenMapper(TOKENIZER)
    assert m([" if", "\n", "(", bytes([32, 105, 102])]) == [297, 200, 9, 297]
    assert m(["\u00e9\u00e9\u00e9 not a token"]) == [-1] and m.misses == 1
    assert eos_token_ids(TOKENIZER) == (0,)  # EOS ids: the one reader, tracekit/modelinfo.py


def test_token_strings_map_through_sentencepiece_pieces(tmp_path):
    """A SentencePiece-style vocab (Metaspace, byte fallback): " if" is "\u2581if", a newline
    with no piece of its own is "<0x0A>"; what is in neither form stays unknown (-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581if": 1, "if": 2, "<0x0A>": 3, "\u2581": 4, "x": 5}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    m = TokenMapper(tmp_path)
    assert m([" if", "if", "\n", b"\n", " x", "zz"]) == [1, 2, 3, 3, -1, -1] and m.misses == 2


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tracekit", "capture", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
    )


def test_cli_errors(tmp_path):
    pf = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    p = _cli("--http", "http://127.0.0.1:9", "--out", str(tmp_path / "o.h5"))
    assert p.returncode == 2 and "--prompts" in p.stderr
    p = _cli("--http", "http://127.0.0.1:9", "--prompts", pf, "--out", str(tmp_path / "o.h5"))
    assert p.returncode == 3 and p.stderr.startswith("Error: ") and "unreachable" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    p = _cli(
        "--http",
        "http://127.0.0.1:9",
        "--prompts",
        pf,
        "--out",
        str(tmp_path / "o.h5"),
        "--api-key-env",
        "TRACEKIT_TEST_UNSET_VAR",
    )
    assert p.returncode == 3 and "TRACEKIT_TEST_UNSET_VAR" in p.stderr
    p = _cli("--http", "http://127.0.0.1:9", "--prompts", pf, "--out", str(tmp_path / "o.h5"), "--arrival", "x")
    assert p.returncode == 3 and "poisson:RATE" in p.stderr


def test_existing_output_needs_resume(tmp_path, capture_to):
    with ReplayServer(routes_for("vllm")) as srv:
        capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="o.h5")
        with pytest.raises(ConfigError, match="--resume"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="o.h5")
        with pytest.raises(ConfigError, match="top-k 5"):
            capture_to(srv.url, [{"id": "a", "prompt": "x"}], name="o.h5", resume=True, top_logprobs=3)


def test_plain_openai_fallback_records_why_and_missing_ids(capture_to):
    """An unknown OpenAI server (llama-cpp-python) without --tokenizer: rows stay ok, ids are -1
    and the row says why; the metadata records the fallback decision."""
    with ReplayServer(routes_for("llama-cpp-python")) as srv:
        s, out = capture_to(srv.url, [{"id": "a", "prompt": "x"}])
    with TraceReader(out) as r:
        assert r.meta.run["dialect"] == "openai" and "plain OpenAI" in r.meta.run["dialect_reason"]
        rec = r.record(0)
        assert rec.status == "ok" and "pass --tokenizer" in rec.error
        assert (r.tokens(0).token_id == -1).all() and r.meta.run["engine"]["headers"]["server"] == "uvicorn"


def test_a_prompt_the_dialect_cannot_send_fails_before_any_file(capture_to, tmp_path):
    with ReplayServer(routes_for("llamacpp")) as srv:
        with pytest.raises(ConfigError, match="needs a text prompt"):
            capture_to(srv.url, [{"id": "a", "prompt": [1, 2, 3]}], name="chat.h5", dialect="openai-chat")
    assert not (tmp_path / "chat.h5").exists()
