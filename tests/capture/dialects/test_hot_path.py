"""The OpenAI/vLLM dialect's parse paths and Acc's compact form give exactly the columns a
plain per-token reference computes, for every event shape: vLLM's "token_id:N" keys with and
without `token_ids`, vLLM 0.33's explicit nulls, ragged top-k, the sampled token listed first,
token strings for the tokenizer, keys with spaces, streamed or as one body."""

from __future__ import annotations

import numpy as np
import pytest

from tracekit.capture.dialects import Acc, get
from tracekit.capture.dialects.acc import token_id_ints


def _event(i: int, keys: list[str], lps: list[float], nulls: bool = False, ids: bool = True, **extra) -> dict:
    ch = {
        "index": 0,
        "text": "x",
        "logprobs": {
            "text_offset": [i],
            "token_logprobs": [lps[0]],
            "tokens": [keys[0]],
            "top_logprobs": [dict(zip(keys, lps))],
        },
        "finish_reason": None,
    }
    if ids:
        ch["token_ids"] = [int(keys[0][9:])] if keys[0].startswith("token_id:") else [len(keys[0])]
    if nulls:  # vLLM 0.33: these are on every chunk, null where they carry nothing
        ch.update(stop_reason=None, prompt_token_ids=None, weight_versions=None)
        ch.setdefault("token_ids", None)
    ch.update(extra.pop("choice", {}))
    return {"id": "c", "object": "text_completion", "choices": [ch], "usage": None, **extra}


def _stream(kind: str) -> list[dict]:
    rng = np.random.default_rng(0)
    evs = []
    for i in range(12):
        w = 3 if kind != "ragged" else 1 + i % 4
        lps = sorted((-rng.random(w) * 5).tolist(), reverse=True)
        keys = [f"token_id:{j}" for j in rng.choice(5000, w, replace=False)]
        if kind == "sampled_first" and i % 3 == 1:  # vLLM lists the sampled token first
            keys, lps = keys[1:] + keys[:1], lps[1:] + lps[:1]
        if kind == "strings":
            keys = [" the", "cat", f"w {i}"][:w] if i % 2 else ["a", "b", "c"][:w]
        if kind == "mixed" and i == 7:
            keys[0] = "a key"  # a space inside a key among "token_id:N" ones
        extra = {}
        if i == 0:
            extra["choice"] = {"prompt_token_ids": [1, 2, 3]}
        if i == 5:
            extra["usage"] = {"prompt_tokens": 3, "completion_tokens": 6}  # continuous usage stats
        if i == 11:
            extra.setdefault("choice", {})["finish_reason"] = "length"
        evs.append(_event(i, keys, lps, nulls=kind in ("nulls", "no_ids"), ids=kind != "no_ids", **extra))
    evs.append(
        {
            "id": "c",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2}},
        }
    )
    return evs


def _reference(evs: list[dict], k: int, to_id) -> tuple[list, list, list]:
    """Per token: chosen id, top-k ids and values in descending value (stable), by hand."""
    chosen, tops, vals = [], [], []
    for ev in evs:
        for ch in ev["choices"]:
            lp = ch["logprobs"]
            d = lp["top_logprobs"][0]
            tid = ch.get("token_ids")
            chosen.append(tid[0] if tid else to_id(lp["tokens"][0]))
            row = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            tops.append([to_id(s) for s, _ in row] + [-1] * (k - len(row)))
            vals.append([v for _, v in row] + [np.nan] * (k - len(row)))
    return chosen, tops, vals


def _to_id(s: str) -> int:
    return int(s[9:]) if s.startswith("token_id:") else len(s)


KINDS = ["token_ids", "no_ids", "nulls", "ragged", "sampled_first", "strings", "mixed"]


@pytest.mark.parametrize("kind", KINDS)
def test_one_path_matches_a_per_token_reference(kind):
    d = get("vllm")
    acc = Acc()
    evs = _stream(kind)
    for j, ev in enumerate(evs):
        d.parse_event(ev, acc, 0.5 * j)
    assert (acc.finish_reason, acc.cached_tokens, acc.prompt_ids) == ("length", 2, [1, 2, 3])
    mapper = lambda strs: [len(s) for s in strs]  # noqa: E731
    cols = acc.columns(4, False, mapper)
    chosen, tops, vals = _reference(evs, 4, _to_id)
    assert cols.token_id.tolist() == chosen
    assert cols.topk_id.tolist() == tops
    np.testing.assert_array_equal(cols.topk_logprob, np.asarray(vals, np.float32))
    assert len(cols.token_id) == 12 and (cols.topk_id[:, 0] >= 0).all() and cols.t_arrival_s[3] == 1.5
    assert np.all(np.diff(cols.topk_logprob[np.isfinite(cols.topk_logprob).all(1)], axis=1) <= 0)  # rank order
    if kind == "token_ids":
        assert (cols.topk_id[:, 3] == -1).all() and np.isnan(cols.topk_logprob[:, 3]).all()  # width 3 < k 4
    if kind == "mixed":
        assert cols.topk_id[7].tolist().count(len("a key")) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_and_one_body_give_the_same_columns(kind):
    """parse_response on the tokens of all events joined in one choice = the streamed events."""
    d = get("vllm")
    evs = _stream(kind)
    streamed = Acc()
    for ev in evs:
        d.parse_event(ev, streamed, 1.0)
    lps = [ev["choices"][0]["logprobs"] for ev in evs if ev["choices"]]
    ids = [ev["choices"][0].get("token_ids") for ev in evs if ev["choices"]]
    body = {
        "choices": [
            {
                "index": 0,
                "logprobs": {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "top_logprobs")},
                "token_ids": [i[0] for i in ids] if all(ids) else None,
                "prompt_token_ids": [1, 2, 3],
                "finish_reason": "length",
            }
        ],
        "usage": evs[-1]["usage"],
    }
    whole = Acc()
    d.parse_response(body, whole, 1.0)
    mapper = lambda strs: [len(s) for s in strs]  # noqa: E731
    a, b = streamed.columns(4, False, mapper), whole.columns(4, False, mapper)
    for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_a_row_with_a_spaced_key_keeps_its_ids():
    """A key holding a space among "token_id:N" keys: every id is still resolved, each on its own."""
    d, acc = get("vllm"), Acc()
    d.parse_event(_event(0, ["token_id:1", "token_id:2"], [-0.1, -2.0]), acc, 0.0)
    d.parse_event(_event(1, ["token_id:3", "odd key"], [-0.2, -3.0]), acc, 0.1)
    d.parse_event(_event(2, ["token_id:5", "token_id:6"], [-0.3, -4.0]), acc, 0.2)
    cols = acc.columns(2, False, lambda strs: [7] * len(strs))
    assert cols.topk_id.tolist() == [[1, 2], [3, 7], [5, 6]]
    np.testing.assert_allclose(cols.topk_logprob[1], [-0.2, -3.0])
    assert acc.columns(2, False, None).topk_id.tolist() == [[1, 2], [3, -1], [5, 6]]  # no tokenizer: unknown


@pytest.mark.parametrize(
    "text,n,want",
    [
        ("token_id:12 token_id:345 token_id:6", 3, [12, 345, 6]),
        ("token_id:12 token_id:x5", 2, None),
        ("token_id:12 token_id:", 2, None),
        ("token_id:1 token_id:-2", 2, None),
        ("token_id:99999999999 token_id:1", 2, None),  # past int32: not a vocabulary id
        ("token_id:1  token_id:2", 2, None),
        ("token_id:1 token_id:2", 3, None),
        ("token_id:١ token_id:2", 2, None),  # a non-ASCII digit
    ],
)
def test_token_id_parse_takes_exactly_the_vllm_form(text, n, want):
    """The bulk parse sees only text it has checked, so numpy never warns or guesses."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = token_id_ints(text, n)
    assert (out is None and want is None) or out.tolist() == want


def test_stream_with_infinity_and_crlf_events_parses_through_the_client():
    """Through a real socket: -Infinity (Python's json.dumps writes it; orjson refuses it, the
    client falls back to json) and a CRLF event in the middle (the SSE spec path) both parse."""
    import json

    from support.sse_replay import capture_stream

    evs = [_event(i, [f"token_id:{i}", "token_id:9"], [-0.5, float("-inf") if i == 1 else -2.0]) for i in range(3)]
    evs[2]["choices"][0]["finish_reason"] = "length"
    body = [b"data: " + json.dumps(e).encode() + (b"\r\n\r\n" if i == 2 else b"\n\n") for i, e in enumerate(evs)]

    outcome, acc = capture_stream(body + [b"data: [DONE]\n\n"], 2)
    assert outcome.record.status == "ok", outcome.record.error
    cols = acc.columns(2, False, None)
    assert cols.topk_id.tolist() == [[0, 9], [1, 9], [2, 9]]
    assert cols.topk_logprob[1, 1] == float("-inf") and acc.finish_reason == "length"


def test_full_width_rows_take_the_fast_path_with_the_general_paths_result():
    """rank_matrix's fast path (every row exactly k wide: a reshape, no sort) gives the general
    path's ids, values and logits bitwise: rows in the engine's order, a row ranked only when it
    is out of order and led by the chosen token (vLLM's sampled token first), NaN kept."""
    from tracekit.capture.dialects import acc as A

    rng = np.random.default_rng(3)
    n, k = 64, 5
    vals = -np.sort(rng.random((n, k)), axis=1)  # descending: rank order
    ids = rng.integers(0, 1000, (n, k))
    chosen = ids[:, 0].copy()
    vals[3] = vals[3][[2, 0, 1, 3, 4]]  # out of order, led by the chosen token: ranked
    ids[7, 0], vals[7] = 999, vals[7][[1, 0, 2, 3, 4]]  # out of order, chosen not first: kept
    vals[9, 2] = np.nan
    logits = rng.standard_normal((n, k))
    widths = np.full(n, k)
    flat = (ids.ravel(), vals.ravel(), logits.ravel())
    fast = A.rank_matrix(widths, *flat, k, chosen)
    orig = A._rank_full
    try:
        A._rank_full = lambda *a: None  # the general path
        general = A.rank_matrix(widths, *flat, k, chosen)
    finally:
        A._rank_full = orig
    for f, g in zip(fast, general):
        assert f.dtype == g.dtype and f.tobytes() == g.tobytes()
    assert np.array_equal(fast[1][7], vals[7].astype(np.float32))  # kept in the engine's order
    assert (np.diff(fast[1][3]) <= 0).all()  # ranked
    assert A._rank_full(flat[0], flat[1], None, n, k, chosen) is None  # row 3 needs the sort
    ok = vals.copy()
    ok[3] = -np.sort(-ok[3])
    assert A._rank_full(flat[0], ok.ravel(), None, n, k, chosen) is not None


def _acc_state(acc: Acc) -> tuple:
    return tuple(getattr(acc, s) for s in Acc.__slots__)


def _edge_events() -> list[dict]:
    """Shapes the one-token hot path must hand to the general path untouched: a null top-k row,
    two tokens in one event, raw logits, a non-list token_ids, bad types (those must raise)."""
    base = _event(0, ["token_id:5", "token_id:6"], [-0.1, -2.0])
    lp = base["choices"][0]["logprobs"]
    null_row = {**base, "choices": [{**base["choices"][0], "logprobs": {**lp, "top_logprobs": [None]}}]}
    two = {
        **base,
        "choices": [
            {
                **base["choices"][0],
                "token_ids": [5, 7],
                "logprobs": {
                    **lp,
                    "tokens": ["token_id:5", "token_id:7"],
                    "token_logprobs": [-0.1, -0.3],
                    "top_logprobs": [{"token_id:5": -0.1}, {"token_id:7": -0.3}],
                },
            }
        ],
    }
    raw = {
        **base,
        "choices": [
            {
                **base["choices"][0],
                "logprobs": {**lp, "top_logits": [[3.0, 1.0]], "top_token_ids": [[5, 6]]},
            }
        ],
    }
    str_ids = {**base, "choices": [{**base["choices"][0], "token_ids": "5"}]}
    # what the event around the choice carries: the event-level prompt ids after the choice's,
    # usage with cached tokens, a second choice (n > 1 is not asked: index 1 is skipped)
    outer = {
        **base,
        "prompt_token_ids": [9, 8],
        "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}},
        "choices": [{**base["choices"][0], "prompt_token_ids": [1], "finish_reason": "stop"}],
    }
    second = {**base, "choices": [{**base["choices"][0], "index": 1}]}
    pair = {**base, "choices": [base["choices"][0], {**base["choices"][0], "index": 1}]}
    return [null_row, two, outer, second, pair, base, str_ids, raw, base]  # raw logits last: all general after it


@pytest.mark.parametrize("kind", [*KINDS, "edges"])
def test_the_one_token_path_appends_what_the_general_path_appends(kind):
    """capture/dialects/openai.py `_one_token` (the streaming hot path) against `_logprobs` (the
    general path) on each event: the same accumulator after every event, every field compared."""
    from tracekit.capture.dialects import openai as O

    d = get("vllm")
    evs = _edge_events() if kind == "edges" else _stream(kind)
    fast, general = Acc(), Acc()
    orig = O._one_token
    for j, ev in enumerate(evs):
        d.parse_event(ev, fast, 0.25 * j)
        try:
            O._one_token = lambda *a: False  # every event through the general path
            d.parse_event(ev, general, 0.25 * j)
        finally:
            O._one_token = orig
        assert _acc_state(fast) == _acc_state(general), (kind, j)
    a, b = fast.columns(4, True, None), general.columns(4, True, None)
    for name in ("token_id", "logprob", "t_arrival_s", "topk_id", "topk_logprob", "topk_logit"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


@pytest.mark.parametrize(
    "logprobs",
    [
        {"tokens": ["token_id:5"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{"token_id:5": -0.1}]},
        {"tokens": ["token_id:5"], "token_logprobs": [-0.1], "top_logprobs": [["token_id:5", -0.1]]},
        {"tokens": ["token_id:5"], "token_logprobs": [-0.1], "top_logprobs": [{}, {}]},
    ],
)
def test_malformed_one_token_events_still_fail_as_shape_errors(logprobs):
    from tracekit.errors import ResponseShapeError

    ev = {"choices": [{"index": 0, "logprobs": logprobs, "token_ids": [5]}]}
    with pytest.raises(ResponseShapeError):
        get("vllm").parse_event(ev, Acc(), 0.0)
