"""`Dialect.bad_body`: the deliberately invalid request of the runner's `bad_request` check.
It must be rejected by validation (not silently clamped or ignored), so it is a wrong-typed
field, never a negative limit (llama.cpp reads -1 as "no limit"; SGLang and TGI never read
`max_tokens`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tracekit.capture.dialects import DIALECTS, RequestSpec, get
from tracekit.capture.dialects.base import BAD_VALUE
from tracekit.engine.process import start_engine

SPEC = RequestSpec("k", "def parse_args(argv):\n    ", 4, 2, False, False)
LIMIT = {  # dialect -> path of its token-limit field in the body
    "openai": ("max_tokens",),
    "openai-chat": ("max_tokens",),
    "vllm": ("max_tokens",),
    "sglang": ("sampling_params", "max_new_tokens"),
    "tgi": ("parameters", "max_new_tokens"),
    "llamacpp": ("n_predict",),
}


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_bad_body_is_the_good_body_with_a_wrong_typed_limit(name):
    """Everything else is the real request, so the rejection can only be the limit's type."""
    d = get(name)
    good, bad = d.body(SPEC), d.bad_body(SPEC)
    *outer, last = LIMIT[name]
    g, b = good, bad
    for k in outer:
        g, b = g[k], b[k]
    assert isinstance(g[last], int) and b[last] == BAD_VALUE
    b[last] = g[last]
    assert bad == good
    assert d.bad_status == (422 if name == "tgi" else 400)


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
def test_the_reference_engine_rejects_it_and_serves_the_next_request():
    """Against a real engine: the bad body gets the dialect's bad_status with a JSON error naming
    the field; the same request with the field fixed is served."""
    with start_engine(["--threads", "1", "--slots", "1"]) as eng:
        for name in ("vllm", "openai"):
            d = get(name)
            status, text = _post(eng.url + d.route(False), d.bad_body(SPEC))
            assert status == d.bad_status, text
            assert "max_tokens" in json.loads(text)["error"]["message"]
            status, text = _post(eng.url + d.route(False), d.body(SPEC))
            assert status == 200 and len(json.loads(text)["choices"][0]["logprobs"]["tokens"]) == 4
