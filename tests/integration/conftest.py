"""Integration tests against a real llama.cpp `llama-server` (issue 13).

They run when TRACEKIT_LLAMA_SERVER points at the binary (scripts/build_llama_server.sh prints
its path; .ci/run builds it once per machine and exports it) and are skipped with that reason
otherwise. One server a module: the fixture model converted to an f32 GGUF
(scripts/convert_tiny_to_gguf.py), 4 slots, f32 KV cache, flash attention off, metrics on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import load_file

ROOT = Path(__file__).resolve().parents[2]
llamacpp = load_file("scripts/llamacpp.py", "llamacpp")
start_server, tiny_gguf = llamacpp.start_server, llamacpp.tiny_gguf

from tracekit.capture.http import CaptureConfig, run_capture  # noqa: E402

BIN = os.environ.get("TRACEKIT_LLAMA_SERVER", "")
SKIP = (
    "TRACEKIT_LLAMA_SERVER is not set: build llama-server with scripts/build_llama_server.sh "
    "and export TRACEKIT_LLAMA_SERVER=<the path it prints>"
)
PROMPTS = ROOT / "fixtures" / "prompts" / "cpu_small.jsonl"  # 8 token-id prompts, 32-token shared prefix
TOKENIZER = ROOT / "fixtures" / "models" / "tiny"


@pytest.fixture(scope="session")
def llama_bin() -> str:
    """The binary, or every test that needs it is skipped with SKIP as the reason."""
    if not BIN:
        pytest.skip(SKIP)
    if not os.access(BIN, os.X_OK):
        pytest.fail(f"TRACEKIT_LLAMA_SERVER={BIN} is not an executable file", pytrace=False)
    return BIN


@pytest.fixture(scope="session")
def gguf(llama_bin, tmp_path_factory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("gguf"), "f32")


@pytest.fixture(scope="module")
def llama(llama_bin, gguf, tmp_path_factory):
    """A llama-server with 4 slots, for one test module."""
    log = tmp_path_factory.mktemp("llama-log") / "llama-server.log"
    with start_server(llama_bin, gguf, slots=4, log_path=str(log)) as eng:
        yield eng


@pytest.fixture
def capture(tmp_path):
    """capture(url, name, prompts=PROMPTS or a list of dicts, **options) -> (summary, out path)."""

    def run(url: str, name: str, prompts=PROMPTS, **kw):
        if not isinstance(prompts, (str, Path)):
            pf = tmp_path / f"{name}.jsonl"
            pf.write_text("".join(json.dumps(p) + "\n" for p in prompts))
            prompts = pf
        out = tmp_path / f"{name}.h5"
        kw.setdefault("top_logprobs", 5)
        kw.setdefault("max_tokens", 32)
        kw.setdefault("ignore_eos", True)
        kw.setdefault("progress", False)
        return run_capture(CaptureConfig(url=url, prompts=str(prompts), out=str(out), **kw)), out

    return run
