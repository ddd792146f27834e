"""One request's failure inside the owner loop ends that request only.

In-process (the real executor on the fixture model, the loop run on this
thread with `run_until_idle`, so nothing depends on timing). Each bad request
reaches the loop by a different door, bypassing the HTTP validation that
normally stops it, because the point is the loop's own guarantee: a seed torch
cannot take (admission), a token id outside the embedding (prefill), a broken
per-request generator (sampling), a corrupted KV length (the batched decode forward).
Before this guarantee, the seed alone killed every request running with it.
"""

from __future__ import annotations

import pytest

from tracekit.engine.engine import Engine, ErrorEvent, GenRequest, TokenEvent
from tracekit.engine.executor import ModelExecutor, default_model_dir

PROMPTS = [[5, 17, 300, 42, 7, 99], [12, 13, 14, 15], [400, 401, 402, 403, 404, 405, 406, 407], [9, 8, 7]]


@pytest.fixture(scope="module")
def executor():
    return ModelExecutor(default_model_dir(), "fp32", slots=8)


def _request(prompt, sink: list, **kw) -> GenRequest:
    return GenRequest(prompt_ids=list(prompt), max_tokens=12, ignore_eos=True, emit=sink.append, **kw)


def _run(executor, reqs: list[GenRequest]) -> None:
    eng = Engine(executor, None)
    for r in reqs:
        eng.submit(r)
    eng.run_until_idle()
    assert eng.free_slots and len(eng.free_slots) == executor.slots, "a slot leaked"
    return eng


def _ids(events: list) -> list[int]:
    assert all(isinstance(e, TokenEvent) for e in events), events
    assert events[-1].finish == "length"
    return [e.token_id for e in events]


@pytest.fixture(scope="module")
def solo(executor) -> list[list[int]]:
    """Each good prompt's tokens, run alone."""
    out = []
    for p in PROMPTS:
        sink: list = []
        _run(executor, [_request(p, sink)])
        out.append(_ids(sink))
    return out


class CorruptLengthAfter:
    """An emit callback that, after the request's n-th token, sets its KV length past the buffer
    (as a bookkeeping bug would): the next batched decode forward holding it fails."""

    def __init__(self, n: int):
        self.n, self.events, self.req, self.req_limit = n, [], None, 0

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if len(self.events) == self.n:
            self.req.length = self.req_limit + 5


@pytest.mark.parametrize("door", ["seed_2_64", "token_outside_vocab", "broken_sampler", "decode_forward"])
def test_bad_request_fails_alone(executor, solo, door):
    """The bad request gets one ErrorEvent naming the failure; every other request in flight
    with it completes all its tokens, equal to its solo run (FP32: batching changes nothing)."""
    good = [[] for _ in PROMPTS]
    reqs = [_request(p, sink) for p, sink in zip(PROMPTS, good)]
    bad_sink: list = []
    if door == "seed_2_64":
        bad = _request(PROMPTS[0], bad_sink, temperature=1.0, seed=2**64)
    elif door == "token_outside_vocab":
        bad = _request([5, executor.vocab_size + 10, 6], bad_sink)
    elif door == "broken_sampler":  # its per-request generator is not one
        bad = _request(PROMPTS[1], bad_sink, temperature=1.0, generator=object())
    else:
        emit = CorruptLengthAfter(3)
        bad = GenRequest(prompt_ids=PROMPTS[2], max_tokens=12, ignore_eos=True, emit=emit)
        emit.req, emit.req_limit, bad_sink = bad, executor.max_context, emit.events
    reqs.insert(2, bad)  # admitted in the same step as the others
    eng = _run(executor, reqs)
    errors = [e for e in bad_sink if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and errors[-1] is bad_sink[-1] and "engine error" in errors[0].message
    assert [_ids(s) for s in good] == solo
    assert eng.counters.errors == 1
