"""Red team, requests and rows: impossible cached-token counts, sampled or different requests, and
which rows are compared (teacher-forced sides, repeated keys, prompts).

Builders and the method: redteam_builders.py."""

from __future__ import annotations

from support.redteam_builders import (
    BASE,
    GREEDY,
    Case,
    R,
    T,
    X,
    Y,
    default_row,
    family_tests,
    flipped,
    prompt_hash,
    softmax_row,
    tie_rows,
)


def cases() -> dict[str, Case]:
    """Bugs: requests and rows."""
    c: dict[str, Case] = {}
    tie_a, tie_b = tie_rows(raw=False)

    # -- cached_tokens ------------------------------------------------------------------------
    # cached_tokens 999 for a 4-token prompt is impossible, yet it makes the boundaries
    # "differ" and a 5-step gap (beyond the 4-step tie) a cache_boundary.
    gap5_a = softmax_row([(X, 18.625), (Y, 18.0)])
    gap5_b = softmax_row([(Y, 18.625), (X, 18.0)])
    c["cached_beyond_prompt"] = Case(
        R(BASE, rows={T: gap5_a}, cached=0),
        R(flipped(T, Y), rows={T: gap5_b}, cached=999),
        opts={"raw": True},
        nums=(999,),
    )

    # -- sampled or different requests ---------------------------------------------------------
    # Temperature sent as a string (vLLM's pydantic and many servers accept "0.7"): read as
    # unknown, so the sampled pair is judged as greedy.
    hot = {"temperature": "0.7", "max_tokens": 6}
    c["temperature_as_string"] = Case(
        R(BASE, rows={T: tie_a}, params=hot),
        R(flipped(T, Y), rows={T: tie_b}, params=hot),
        expect="incomparable",
        words=("temperature",),
    )
    # The recorded (OpenAI-style) request body has no temperature: OpenAI-compatible servers
    # then sample (OpenAI and vLLM default 1.0, llama.cpp 0.8). Absent is not greedy (TGI's
    # body, with do_sample false, is another matter).
    c["temperature_absent_from_body"] = Case(
        R(BASE, rows={T: tie_a}, params={"max_tokens": 6}),
        R(flipped(T, Y), rows={T: tie_b}, params={"max_tokens": 6}),
        expect="incomparable",
        words=("temperature",),
    )
    # A and B sent different requests: B added logit_bias on its own token (or a penalty).
    # The flip is the bias, not numerics.
    c["requests_differ_logit_bias"] = Case(
        R(BASE, rows={T: tie_a}, params=GREEDY),
        R(flipped(T, Y), rows={T: tie_b}, params={**GREEDY, "logit_bias": {str(Y): 0.3}}),
        expect="incomparable",
        words=("logit_bias",),
    )
    c["requests_differ_penalty"] = Case(
        R(BASE, rows={T: tie_a}, params=GREEDY),
        R(flipped(T, Y), rows={T: tie_b}, params={**GREEDY, "repetition_penalty": 1.3}),
        expect="incomparable",
        words=("repetition_penalty",),
    )

    # -- which rows are compared ----------------------------------------------------------------
    # B is a teacher-forced trace that replayed another sequence (5, 6, 77, 77, 77, 77) than A
    # generated: from position 3 on its predictions saw another prefix, yet its top-1s equal
    # A's tokens and the pair is "identical".
    tf = R([5, 6, 77, 77, 77, 77], rows={t: default_row(tok) for t, tok in enumerate(BASE)}, history="full")
    c["teacher_side_replayed_other_tokens"] = Case(
        R(BASE), tf, opts_b={"source": "teacher_forced"}, expect="incomparable", words=("77",)
    )
    # B holds the key twice (two ok rows told apart by a history label, as the writer allows):
    # the first answer diverges with a token outside A's top-k, the last copies A. Only the
    # last is compared (a note says the key repeats), exit 0: two answers to one request.
    c["repeated_key_hides_first_answer"] = Case(
        R(BASE), [R(flipped(T, 4242), history="try1"), R(BASE, history="try2")], words=("4242",)
    )
    # Different prompts (prompt_hash differs: two texts) whose prompt ids were stored as an
    # empty list on both sides: 0 = 0 ids "agree" and the hash is never looked at.
    c["empty_prompt_ids_hide_hash"] = Case(
        R(BASE, rows={T: tie_a}, prompt=(), phash=prompt_hash("Hello")),
        R(flipped(T, Y), rows={T: tie_b}, prompt=(), phash=prompt_hash("Goodbye")),
        expect="incomparable",
        words=("prompt",),
    )

    # -- what the engine reported, checked on every row (analyze/reported.py) ------------------
    # cached_tokens 17 where the engine says its KV blocks hold 16 tokens: no block boundary,
    # so no reuse the engine could have done; the tie at T must not hide the misreport.
    block16 = {"dtype": "bf16", "engine": {"v1_models": {"meta": {"block_size": 16}}}}
    tie_ra, tie_rb = tie_rows(raw=True)
    c["cached_tokens_not_a_block_multiple"] = Case(
        R(BASE, rows={T: tie_ra}, cached=16, prompt=tuple(range(11, 51))),
        R(flipped(T, Y), rows={T: tie_rb}, cached=17, prompt=tuple(range(11, 51))),
        opts={"raw": True, "run": block16},
        words=("not a multiple of its KV block size",),
        nums=(17, 16),
    )
    # B's top-k row before the flip listed in ascending order (a stale or misordered row
    # from a broken response builder); its chosen token still agrees with the row.
    c["topk_row_out_of_order"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: tie_b, 1: list(reversed(default_row(BASE[1])))}),
        words=("not sorted",),
    )
    # The seed flip with both top-k rows in ascending order: an engine that does not sort
    # its rows (or a response builder that reversed them) was once accepted as benign; the
    # order is part of what the engine reports, and a misordered row is not trusted.
    for raw, name in ((True, "raw_logits"), (False, "logprobs_only")):
        ra_, rb_ = tie_rows(raw=raw)
        c[f"seed_rows_unsorted_{name}"] = Case(
            R(BASE, rows={T: ra_[::-1]}), R(flipped(T, Y), rows={T: rb_[::-1]}), {"raw": raw}, words=("not sorted",)
        )
    # A logprob above 0 (a probability above 1) in B's row before the flip.
    c["logprob_above_zero"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: tie_b, 1: [(BASE[1], 0.25), (50, -3.0), (51, -4.0)]}),
        words=("above 0",),
        nums=(0.25,),
    )
    # B's top-k probabilities before the flip sum to 2.46 (each entry plausible alone).
    c["topk_mass_above_one"] = Case(
        R(BASE, rows={T: tie_a}),
        R(flipped(T, Y), rows={T: tie_b, 1: [(BASE[1], -0.1), (50, -0.2), (51, -0.3)]}),
        words=("sum to",),
        nums=(2.465,),
    )
    return c


CASES = cases()

# What fooled the classifier before its fix: the wrong verdict it gave and the check that was missing.
FIXED = {
    "cached_beyond_prompt": "cache_boundary; cached_tokens > prompt length is accepted as a boundary",
    "temperature_as_string": "bf16_tie_flip; a string temperature reads as unknown, unknown as greedy",
    "temperature_absent_from_body": "bf16_tie_flip; a request body without temperature is taken as greedy",
    "requests_differ_logit_bias": "bf16_tie_flip; A's and B's request bodies are never compared",
    "requests_differ_penalty": "bf16_tie_flip; A's and B's request bodies are never compared",
    "teacher_side_replayed_other_tokens": "identical; a teacher-forced side's replayed tokens are never "
    "compared with the other side's",
    "repeated_key_hides_first_answer": "identical (a note); the first of two ok answers to one key is dropped",
    "empty_prompt_ids_hide_hash": "bf16_tie_flip; empty prompt ids on both sides count as equal prompts",
    "cached_tokens_not_a_block_multiple": "bf16_tie_flip; cached_tokens never checked against the engine's block size",
    "topk_row_out_of_order": "bf16_tie_flip; top-k rows before the difference were never read",
    "seed_rows_unsorted_raw_logits": "bf16_tie_flip; unsorted top-k rows were accepted (then a benign case)",
    "seed_rows_unsorted_logprobs_only": "bf16_tie_flip; unsorted top-k rows were accepted (then a benign case)",
    "logprob_above_zero": "bf16_tie_flip; logprobs before the difference were never checked for sign",
    "topk_mass_above_one": "bf16_tie_flip; the top-k mass was checked only at the difference",
}
FOOLED: dict[str, str] = {}  # what fools it today


test_records_name_cases_of_this_family, test_bug_is_not_benign = family_tests(CASES, FIXED, FOOLED)
