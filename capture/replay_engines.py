"""How each engine gives its own logprobs of given tokens (the engine-side replay), read in its
source (docs/engines.md, "Engine-side replay", names the files and commits).

One class per engine, each with: `refuses(kind)` (why a history cannot be achieved, or ""),
`limits()` (what it cannot give, recorded in the trace), and `replay(session, seq, boundary)`
(boundary 0 = cold; B > 0 = the cache emptied, primed with the prompt's first B tokens, then the
replay). A replay returns, per traced token, its logprob (None = the engine did not give it),
its top-k row, the reused boundary the engine reported (-1 = none) and how cold/warm is proven.

- tracekit serve: `forced_tokens` (its teacher-forcing extension: the prompt's prefill at the
  boundary, then one decode step per traced token, the live run's own path; raw logits too) or
  vLLM-style `prompt_logprobs` (one prefill forward); `/reset_prefix_cache`; reports cached_tokens.
- vLLM: `prompt_logprobs` on /v1/completions. A request with prompt_logprobs never reads the prefix
  cache, so it is cold by construction and warm cannot be replayed this way.
- SGLang: native /generate with `return_logprob`, `logprob_start_len` (the prompt length - 1; the
  entries are aligned to the traced tokens by the ids SGLang lists) and `top_logprobs_num`;
  `/flush_cache`; `meta_info.cached_tokens`. The radix match is capped at logprob_start_len, so a
  primed boundary inside the prompt is reused.
- TGI: `decoder_input_details` (prefill logprobs, no top-k for them); such a request bypasses the
  radix cache: cold only; text in, so the ids are decoded and the engine's ids checked.
- llama.cpp: no prompt logprobs: step by step (prompt + traced tokens before t, `n_predict` 1,
  `n_probs` k), `cache_prompt` false for cold (`timings.cache_n` 0), a primed slot for warm.
  The traced token's logprob is known only when it is in the top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracekit.errors import ConfigError


class Unsupported(Exception):
    """This replay cannot be done as asked (one line: why)."""


@dataclass
class Replayed:
    logprobs: list  # [G] float | None
    top: list  # [G] list of (id, logprob, logit | None)
    cached_tokens: int = -1
    proof: str = ""
    notes: dict = field(default_factory=dict)
    error: str = ""


async def _post(session, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise Unsupported(f"POST {url.rsplit('/', 1)[-1]} answered HTTP {r.status}: {text[:200]}")
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


def _cached(obj: dict) -> int:
    v = ((obj.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return int(v) if isinstance(v, int) else -1


class _Base:
    name = ""
    method = ""
    raw_logits = False

    def __init__(self, cfg, pr):
        self.cfg, self.base, self.k, self.model = cfg, cfg.url.rstrip("/"), cfg.top_logprobs, pr.model
        if self.name != "tracekit" and cfg.method not in ("auto",):
            raise ConfigError(f"--replay-method {cfg.method}: only for tracekit serve ({self.name} has one way)")
        meta = (pr.engine.get("v1_models") or {}).get("meta") or {}
        self.dtype = str(meta.get("dtype") or "")

    def refuses(self, kind: str) -> str:
        return ""

    def limits(self) -> dict:
        return {}

    def _body(self, **kw) -> dict:
        return {**({"model": self.model} if self.model else {}), "temperature": 0, **kw}


def _prompt_lp_rows(seq, rows: list, k: int) -> tuple[list, list]:
    """vLLM's prompt_logprobs entries at the traced positions -> (logprobs, top rows)."""
    p = len(seq.prompt_ids)
    lps, tops = [], []
    for t, tok in enumerate(seq.gen_ids.tolist()):
        entry = rows[p + t] if p + t < len(rows) else None
        if not entry:
            lps.append(None)
            tops.append([])
            continue
        mine = entry.get(str(tok))
        lps.append(mine["logprob"] if mine else None)
        ranked = sorted(((e["rank"], int(i), e) for i, e in entry.items() if e.get("rank") is not None))
        tops.append([(i, e["logprob"], e.get("logit")) for r, i, e in ranked if r <= k])
    return lps, tops


class TracekitReplay(_Base):
    name = "tracekit"
    raw_logits = True

    def __init__(self, cfg, pr):
        super().__init__(cfg, pr)
        self.method = "forced" if cfg.method in ("auto", "forced") else "prompt-logprobs"
        if cfg.method not in ("auto", "forced", "prompt-logprobs"):
            raise ConfigError(f"--replay-method {cfg.method}: tracekit serve takes forced or prompt-logprobs")

    async def _reset_prime(self, session, seq, b: int) -> None:
        await _post(session, self.base + "/reset_prefix_cache", {})
        if b:
            await _post(
                session, self.base + "/v1/completions", self._body(prompt=seq.prompt_ids[:b].tolist(), max_tokens=1)
            )

    async def replay(self, session, seq, b: int) -> Replayed:
        await self._reset_prime(session, seq, b)
        p, g = seq.prompt_ids.tolist(), seq.gen_ids.tolist()
        if self.method == "forced":
            body = self._body(
                prompt=p,
                forced_tokens=g,
                logprobs=self.k,
                return_raw_logits=True,
                return_tokens_as_token_ids=True,
                return_token_ids=True,
                ignore_eos=True,
            )
            js = await _post(session, self.base + "/v1/completions", body)
            c = js["choices"][0]
            if c.get("token_ids") != g:
                raise Unsupported("the engine did not feed back the forced tokens (is it tracekit serve?)")
            lp = c["logprobs"]
            tops = []
            for ids, lgs, d in zip(lp["top_token_ids"], lp["top_logits"], lp["top_logprobs"]):
                tops.append([(i, d[f"token_id:{i}"], lg) for i, lg in zip(ids, lgs)])
            return Replayed(list(lp["token_logprobs"]), tops, _cached(js), "cached_tokens reported by the engine")
        body = self._body(prompt=p + g, max_tokens=1, prompt_logprobs=self.k, return_raw_logits=True)
        js = await _post(session, self.base + "/v1/completions", body)
        lps, tops = _prompt_lp_rows(seq, js["choices"][0]["prompt_logprobs"], self.k)
        return Replayed(lps, tops, _cached(js), "cached_tokens reported by the engine")

    def limits(self) -> dict:
        return {
            "forced": "the live path: prefill at the boundary, then one decode step per traced token",
            "prompt-logprobs": "one prefill forward over prompt + traced tokens (not the decode path)",
        }


VLLM_WARM = (
    "vLLM never reads the prefix cache for a request with prompt_logprobs (vllm/v1/core/kv_cache_manager.py "
    "get_computed_blocks, commit 003df2961dd8): a warm replay cannot be asked this way"
)


class VllmReplay(_Base):
    name = "vllm"
    method = "prompt-logprobs"

    def refuses(self, kind: str) -> str:
        return VLLM_WARM if kind == "warm" else ""

    def limits(self) -> dict:
        return {
            "warm": VLLM_WARM,
            "top_k": "prompt_logprobs is capped by the server's --max-logprobs (default 20)",
            "raw_logits": "none (only with --logprobs-mode raw_logits, which then replaces the logprobs)",
            "cached_tokens": "reported only with --enable-prompt-tokens-details",
        }

    async def replay(self, session, seq, b: int) -> Replayed:
        if b:
            raise Unsupported(VLLM_WARM)
        p, g = seq.prompt_ids.tolist(), seq.gen_ids.tolist()
        js = await _post(
            session, self.base + "/v1/completions", self._body(prompt=p + g, max_tokens=1, prompt_logprobs=self.k)
        )
        lps, tops = _prompt_lp_rows(seq, js["choices"][0]["prompt_logprobs"], self.k)
        cached = _cached(js)
        proof = "cached_tokens reported by the engine" if cached >= 0 else VLLM_WARM.replace("a warm replay", "so cold")
        return Replayed(lps, tops, cached if cached >= 0 else 0, proof)


class SglangReplay(_Base):
    name = "sglang"
    method = "input-logprobs"

    def limits(self) -> dict:
        return {
            "raw_logits": "none",
            "warm": "the radix match is capped at logprob_start_len (python/sglang/srt/managers/schedule_batch.py "
            "Req._compute_max_prefix_len): a boundary up to the prompt length is reusable",
        }

    async def replay(self, session, seq, b: int) -> Replayed:
        p, g = seq.prompt_ids.tolist(), seq.gen_ids.tolist()
        await _post(session, self.base + "/flush_cache", {})
        if b:
            await _post(
                session, self.base + "/generate", {"input_ids": p[:b], "sampling_params": {"max_new_tokens": 1}}
            )
        body = {
            "input_ids": p + g,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": len(p) - 1,
            "top_logprobs_num": self.k,
            "return_text_in_logprobs": False,
        }
        js = await _post(session, self.base + "/generate", body)
        mi = js.get("meta_info") or {}
        ins, tops_in = mi.get("input_token_logprobs") or [], mi.get("input_top_logprobs") or []
        ids = [None if e is None or e[1] is None else int(e[1]) for e in ins]
        # Which entry scores traced token 0 is found by the ids the engine lists (entry k scores the
        # token at logprob_start_len + k, or + k + 1 where the first entry is left out): never assumed.
        off = next((o for o in (0, 1, 2) if ids[o : o + len(g)] == g), None)
        if off is None:
            raise Unsupported(f"input_token_logprobs do not list the traced tokens after position {len(p) - 1}")
        lps = [e[0] for e in ins[off : off + len(g)]]
        tops = [[(int(e[1]), e[0], None) for e in (row or [])] for row in tops_in[off : off + len(g)]]
        tops += [[] for _ in range(len(g) - len(tops))]
        cached = mi.get("cached_tokens")
        return Replayed(lps, tops, int(cached) if isinstance(cached, int) else -1, "meta_info.cached_tokens")


TGI_WARM = (
    "TGI does not use its prefix cache for a request with decoder_input_details (backends/v3/src/queue.rs, "
    "commit db931fcf42da): a warm replay cannot be asked this way"
)


class TgiReplay(_Base):
    name = "tgi"
    method = "decoder-input-details"

    def refuses(self, kind: str) -> str:
        if kind == "warm":
            return TGI_WARM
        if not self._tokenizer_dir():
            return "TGI takes text only: give --tokenizer DIR (the model's HF directory) to decode the traced ids"
        return ""

    def _tokenizer_dir(self) -> str:
        return self.cfg.tokenizer or ""

    def limits(self) -> dict:
        return {
            "warm": TGI_WARM,
            "top_k": "none for prefill positions (details.prefill has id, text, logprob only)",
            "server": "prefill logprobs need the server started with REQUEST_LOGPROBS=1 "
            "(server/text_generation_server/models/globals.py)",
        }

    async def replay(self, session, seq, b: int) -> Replayed:
        if b:
            raise Unsupported(TGI_WARM)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self._tokenizer_dir())
        ids = seq.prompt_ids.tolist() + seq.gen_ids.tolist()
        text = tok.decode(ids)
        body = {"inputs": text, "parameters": {"max_new_tokens": 1, "decoder_input_details": True, "details": True}}
        js = await _post(session, self.base + "/generate", body)
        pre = (js.get("details") or {}).get("prefill") or []
        got = [int(e["id"]) for e in pre][-len(ids) :]
        if got != ids:
            raise Unsupported("TGI tokenized the decoded text into other ids than the trace's: not replayable")
        lps = [e.get("logprob") for e in pre[-len(seq.gen_ids) :]]
        if all(v is None for v in lps):
            raise Unsupported("details.prefill has no logprobs: start TGI with REQUEST_LOGPROBS=1")
        return Replayed(lps, [[] for _ in lps], 0, TGI_WARM.replace("a warm replay", "so cold"))


class LlamaCppReplay(_Base):
    name = "llamacpp"
    method = "step-by-step"

    def limits(self) -> dict:
        return {
            "prompt_logprobs": "none: one request per traced token (prompt + tokens before it, n_predict 1)",
            "top_k": "the traced token's logprob is known only when it is in the n_probs top-k",
            "raw_logits": "none",
            "warm": "the slot is primed with the prompt's first B tokens before every step (id_slot 0); "
            "timings.cache_n says what was reused (the last prompt token is always re-run)",
        }

    async def replay(self, session, seq, b: int) -> Replayed:
        p, g = seq.prompt_ids.tolist(), seq.gen_ids.tolist()
        lps, tops, reused, missing = [], [], [], 0
        for t in range(len(g)):
            if b:
                prime = {"prompt": p[:b], "n_predict": 1, "cache_prompt": True, "id_slot": 0, "temperature": 0}
                await _post(session, self.base + "/completion", prime)
            body = {
                "prompt": p + g[:t],
                "n_predict": 1,
                "n_probs": self.k,
                "cache_prompt": bool(b),
                "temperature": 0,
                **({"id_slot": 0} if b else {}),
            }
            js = await _post(session, self.base + "/completion", body)
            probs = js.get("completion_probabilities") or []
            row = (probs[0].get("top_logprobs") if probs else None) or []
            top = [(int(e["id"]), float(e["logprob"]), None) for e in row]
            mine = next((lp for i, lp, _ in top if i == g[t]), None)
            missing += mine is None
            lps.append(mine)
            tops.append(top)
            reused.append(int((js.get("timings") or {}).get("cache_n", -1)))
        notes = {"cache_n_per_step": reused, "not_in_topk": missing}
        err = ""
        if len(set(reused)) > 1:
            err = f"the engine reused different boundaries across the steps: {sorted(set(reused))}"
        proof = "timings.cache_n of every step" + (" (cache_prompt false)" if not b else " (slot 0 primed)")
        return Replayed(lps, tops, reused[0] if reused else -1, proof, notes, err)


ENGINES = {
    "tracekit": TracekitReplay,
    "vllm": VllmReplay,
    "sglang": SglangReplay,
    "tgi": TgiReplay,
    "llamacpp": LlamaCppReplay,
}


def engine_for(kind: str, cfg, pr):
    return ENGINES[kind](cfg, pr)
