"""`tracekit stats`: unique completions, first splits and the flip rate by gap, on
hand-built traces whose answers are known, and on the reference engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.analyze_builders import Req, flip, write_trace

from tracekit.analyze.repeats import first_divergence, reproducibility, split_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _repeats(prompt: str, seqs: list[list[int]], rows=None, **kw) -> list[Req]:
    return [Req(f"{prompt}#r{i}", s, rows=dict(rows or {}), **kw) for i, s in enumerate(seqs)]


def test_split_key_and_first_divergence():
    import numpy as np

    assert split_key("p017#r12") == ("p017", 12)
    assert split_key("a#b#r3") == ("a#b", 3)
    assert split_key("p017") == ("p017", 0)
    assert split_key("p#rx") == ("p#rx", 0)
    a = np.array([1, 2, 3])
    assert first_divergence(a, np.array([1, 2, 3])) is None
    assert first_divergence(a, np.array([1, 9, 3])) == 1
    assert first_divergence(a, np.array([1, 2])) == 2  # a prefix: splits where it ends


def test_counts_against_the_most_common_completion(tmp_path):
    """Three of five repeats agree (the reference); one flips at 2 where the reference's
    top-2 gap is 0.05 nats, one at 1 where it is an exact tie: trials and flips per bin
    are exact counts, so a miscount of either shows."""
    ref = [5, 6, 7, 8]
    rows = {1: flip(6, 9, -0.7, -0.7), 2: flip(7, 9, -0.67, -0.72)}  # gaps: 0 and 0.05 nats
    reqs = _repeats("p", [[5, 9, 7, 8], ref, ref, [5, 6, 9, 8], ref], rows=rows)
    reqs += [Req("lonely", [1, 2, 3])]
    path = write_trace(tmp_path / "r.h5", reqs)
    r = reproducibility([path])
    p = {q.prompt: q for q in r.prompts}["p"]
    assert (p.completions, p.unique, p.reference, p.reference_count) == (5, 3, "p#r1", 3)
    assert p.first_split == 1 and p.split_positions == (1, 2)
    assert r.completions == 6 and r.unique == 4 and r.first_split == 1
    c = r.gap_nats
    labels = c.bin_labels()
    got = {labels[i]: (c.trials[i], c.flips[i]) for i in range(len(labels)) if c.trials[i]}
    # position 0: 5 trials (gap 5 nats, "> 2"); 1: 5 trials, 1 flip (tie); 2: 4 trials, 1 flip
    # (0.05 nats); 3: 3 trials ("> 2"); plus the single completion "lonely": 3 trials ("> 2").
    assert got == {"0 (exact tie)": (5, 1), "(0.03125, 0.0625]": (4, 1), "> 2": (5 + 3 + 3, 0)}
    assert r.gap_steps is None  # no raw logits
    assert r.headline().startswith("6 completions of 2 prompts → 4 unique, first split at token 1")


def test_reference_repeat_zero(tmp_path):
    """With --reference r0 the odd repeat 0 is the reference, so both others split from it."""
    path = write_trace(tmp_path / "r.h5", _repeats("q", [[1, 2, 3], [1, 4, 3], [1, 4, 3]]))
    mode = reproducibility([path]).prompts[0]
    r0 = reproducibility([path], reference="r0").prompts[0]
    assert (mode.reference, mode.reference_count, mode.split_positions) == ("q#r1", 2, (1,))
    assert (r0.reference, r0.reference_count, r0.split_positions) == ("q#r0", 1, (1, 1))


def test_gap_in_grid_steps_and_failed_rows(tmp_path):
    """With raw BF16 logits the gap is counted in steps of the bf16 grid (10.0 vs 9.9375 is
    one step); a failed row is left out and counted; repeats pool across files."""
    rows = {0: flip(3, 4, -0.69, -0.75, 10.0, 9.9375)}
    a = write_trace(tmp_path / "a.h5", _repeats("p", [[3, 7], [4, 7]], rows=rows), raw=True, run={"dtype": "bf16"})
    b = write_trace(
        tmp_path / "b.h5",
        [Req("p#r2", [3, 7], rows=rows), Req("p#r3", [3, 7], status="error")],
        raw=True,
        run={"dtype": "bf16"},
    )
    r = reproducibility([a, b])
    assert r.skipped_rows == 1
    (p,) = r.prompts
    assert (p.completions, p.unique, p.split_positions) == (3, 2, (0,))
    labels = r.gap_steps.bin_labels()
    one = labels.index("(0, 1]")
    assert (r.gap_steps.trials[one], r.gap_steps.flips[one]) == (3, 1)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tracekit", "stats", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_cli_json_plot_and_errors(tmp_path):
    path = write_trace(tmp_path / "r.h5", _repeats("q", [[1, 2, 3], [1, 4, 3], [1, 2, 3]]))
    png = tmp_path / "stats.png"
    out = _cli(path, "--json", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout is exactly one JSON document
    assert doc["schema"] == "tracekit.percentiles/1" and doc["unique"] == 2 and doc["first_split"] == 1
    assert doc["split_positions"]["histogram"] == {"1": 1}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = _cli(path)
    assert text.returncode == 0 and text.stdout.startswith("3 completions → 2 unique, first split at token 1")
    bad = _cli(str(tmp_path / "missing.h5"))
    assert bad.returncode == 3 and bad.stderr.startswith("Error: ") and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_fp32_repeats_on_the_reference_engine_are_one_completion_each(tmp_path):
    """FP32 on the reference engine agrees to ~1e-5 whatever the batch: K repeats at
    concurrency 4 must give one completion per prompt, counted from a real capture."""
    from tracekit.capture.http import CaptureConfig, run_capture
    from tracekit.engine.process import start_engine

    with start_engine(["--threads", "1", "--slots", "4"], log_path=str(tmp_path / "engine.log")) as eng:
        s = run_capture(
            CaptureConfig(
                url=eng.url,
                prompts=str(ROOT / "fixtures/prompts/cpu_small.jsonl"),
                out=str(tmp_path / "fp32.h5"),
                concurrency=4,
                repeat=3,
                top_logprobs=5,
                ignore_eos=True,
                progress=False,
            )
        )
    assert s.counts["ok"] == 24
    r = reproducibility([tmp_path / "fp32.h5"])
    assert r.completions == 24 and len(r.prompts) == 8
    assert r.unique == 8 and r.first_split is None and r.ok
    # the prompt file sets max_tokens 32 per prompt (it overrides --max-tokens)
    assert sum(r.gap_steps.trials) == 24 * 32 and sum(r.gap_steps.flips) == 0
