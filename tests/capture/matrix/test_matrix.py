"""Matrix files: the shipped ones parse into the cells they promise; bad ones
get one clear `Error:` line (exit 3) naming the key at fault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.capture.matrix import load_matrix
from tracekit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
MATRIX = ROOT / "fixtures" / "matrix"


def test_study_matrix_mirrors_the_study():
    m = load_matrix(MATRIX / "study.toml")
    cells = m.cells()
    # 3 input lengths x 2 concurrencies x 2 dtypes x 2 cache settings, 32 output tokens each.
    assert len(cells) == 24
    assert {c.prompts for c in cells} == {"in128", "in2048", "in8192"}
    assert {c.concurrency for c in cells} == {4, 8}
    assert {c.dtype for c in cells} == {"bf16", "fp32"}
    assert {c.prefix_cache for c in cells} == {True, False}
    assert {c.output_tokens for c in cells} == {32}
    assert m.settings.ignore_eos is True
    args = m.target("ref").args
    assert args[args.index("--slots") + 1] == "4" and args[args.index("--max-context") + 1] == "9216"
    # One engine per (dtype, cache): 4 engine configurations, each serving 6 cells.
    assert len({c.engine_id for c in cells}) == 4
    assert [p.input_tokens for p in m.prompt_sets] == ["128", "2048", "8192"]


def test_cpu_small_and_demo_parse():
    small = load_matrix(MATRIX / "cpu_small.toml")
    ids = [c.id for c in small.cells()]
    assert len(ids) == 9 and ids[-1] == "ref-fault.fp32.cache-on.cpu_small.out32.c8"
    assert "corrupt-prefix-cache" in small.target("ref-fault").args
    demo = load_matrix(MATRIX / "demo.toml")
    assert {c.dtype for c in demo.cells()} == {"fp32", "bf16"} and all(c.prefix_cache for c in demo.cells())
    # Relative paths are resolved against the matrix file, not the working directory.
    assert all(Path(p.path).is_file() for p in demo.prompt_sets)
    # The yardstick (workflows/judge.py): a fault target never calibrates; serve targets reset their cache
    assert small.target("ref").calibrate and not small.target("ref-fault").calibrate
    assert small.target("ref").reset_path == "/reset_prefix_cache"
    assert small.settings.calibration_repeats == 1 and small.settings.cold_reference


BASE = """
[[prompts]]
name = "p"
path = "{prompts}"
[[target]]
name = "ref"
serve = []
"""


URL_T = "[[target]]\nname = 'x'\nurl = 'http://127.0.0.1:1'\ndtype = 'fp32'\nprefix_cache = true\n"


def test_targets_that_are_not_serve_take_a_tokenizer_and_eos_ids(tmp_path):
    """Issue 24, item 5: a llama.cpp (url or command) target names the served model's tokenizer
    (relative to the matrix file) and EOS ids; the cells' captures get them."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    f = tmp_path / "m.toml"
    f.write_text(
        BASE.format(prompts=ROOT / "fixtures/prompts/cpu_small.jsonl") + URL_T + "tokenizer = 'tok'\n"
        "eos_token_ids = [0, 7]\n"
    )
    t = load_matrix(f).target("x")
    assert t.tokenizer == str(tmp_path / "tok") and t.eos_token_ids == (0, 7)
    assert load_matrix(f).target("ref").tokenizer is None


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("[axes]\ndtype = ['fp8']", "dtype ['fp8']: each must be one of fp32, bf16, fp16"),
        ("[axes]\nconcurency = [4]", "unknown key(s) ['concurency']"),
        ("[axes]\nconcurrency = [0]", "'concurrency' values must be >= 1"),
        ("[axes]\nconcurrency = [4, 4]", "lists a value twice"),
        ("[axes]\nprompts = ['nope']", "prompts ['nope'] (target ref) are not [[prompts]] names"),
        ("[run]\ntimeout_s = 'soon'", "'timeout_s' must be a number"),
        ("[[target]]\nname = 'x'\nurl = 'http://127.0.0.1:1'", "a 'url' target is one fixed engine"),
        ("[[target]]\nname = 'x'\ncommand = ['vllm']", "a 'command' target needs 'url'"),
        ("[[target]]\nname = 'ref'\nserve = []", "two [[target]] tables share a name"),
        ("[[prompts]]\nname = 'q'\npath = 'missing.jsonl'", "missing.jsonl does not exist"),
        ("tokenizer = 'x'", "'tokenizer' and 'eos_token_ids' are for targets that are not 'serve'"),
        (URL_T + "tokenizer = 'nowhere'", "holds no tokenizer.json"),
        (URL_T + "eos_token_ids = ['2']", "'eos_token_ids' must be a list of token ids"),
        ("[run]\ncalibration_repeats = -1", "calibration_repeats must be >= 0"),
        ("[[target]]\nname = 'x'\nserve = []\nreset_path = 'flush'", "'reset_path' must be a route starting with '/'"),
        ("[[target]]\nname = 'x'\nserve = []\ncalibrate = 'yes'", "'calibrate' must be a bool"),
    ],
)
def test_bad_matrix_errors_name_the_key(tmp_path, extra, needle):
    f = tmp_path / "m.toml"
    f.write_text(BASE.format(prompts=ROOT / "fixtures/prompts/cpu_small.jsonl") + extra + "\n")
    with pytest.raises(ConfigError) as e:
        load_matrix(f)
    assert needle in str(e.value) and str(f) in str(e.value)


def test_cli_bad_matrix_is_one_error_line(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("name = [unclosed\n")
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", "run", str(f), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    assert p.returncode == 3 and p.stdout == ""
    assert p.stderr.startswith("Error: ") and "not valid TOML" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o" / "cells").exists()
