"""What an HTTP capture records about its run, and what `--resume` checks against it.

- the dtype the engine runs (`dtype`, `dtype_source`): the engine's own report where it
  gives one (tracekit serve's `/v1/models` meta, vLLM's `/server_info`, SGLang's
  `/server_info` (or its old name `/get_server_info`), TGI's `/info` before v2.3), else the
  `--dtype` label, else unknown (null); the classifier picks its grid from it;
- the engine family (`engine_family`: the engine behind the server, whatever dialect talks to
  it), which `tracekit diff` reads to say what differs between engines;
- what the logprob fields hold (`logprobs_mode`, `logprobs_mode_source`): vLLM's
  `--logprobs-mode raw_logits` / `processed_logits` return logits there, which the
  capture stores as raw top-k logits (`topk_logit`), never as logprobs;
- the effective sampling of the planned requests (command line over prompt file);
- the parts of a configuration a resumed run must share with the trace it completes;
- `build`: the whole run metadata a capture starts with, built as a RunRecord
  (tracekit/runrecord.py) and stored as its JSON.

No network I/O except the probes in `engine_numerics`; `build` reads the prompt file's hash and
the tokenizer directory's EOS ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracekit import dtypes
from tracekit.errors import ConfigError
from tracekit.files import sha256_file
from tracekit.modelinfo import eos_token_ids
from tracekit.runinfo import base_run
from tracekit.runrecord import CacheFacts, DTypeLabel, EngineReport, RunRecord

from .dialects import RequestSpec

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
LOGIT_MODES = ("raw_logits", "processed_logits")

# Engine spellings of a dtype -> tracekit's name: the one alias table (tracekit/dtypes.py ALIASES);
# None for anything else ("auto" and the like are not a dtype).
dtype_name = dtypes.normalise


async def engine_numerics(session, base: str, dialect: str, engine: dict) -> dict:
    """{'dtype': ..., 'logprobs_mode': ..., 'source': {...}} as far as the engine reports them.
    Probes only the engine's own routes for its dialect; a route that fails reports nothing."""
    from .probe import _get  # the probe's GET: status, JSON, headers; never raises

    meta = (engine.get("v1_models") or {}).get("meta") or {}
    found: dict = {"dtype": None, "logprobs_mode": None, "source": {}}
    if dtype_name(meta.get("dtype")):  # tracekit serve
        found["dtype"], found["source"]["dtype"] = dtype_name(meta["dtype"]), "/v1/models meta.dtype"
    if dialect == "vllm" and found["dtype"] is None:
        # Only with VLLM_SERVER_DEV_MODE=1; a production server answers 404.
        st, body, _ = await _get(session, base + "/server_info?config_format=json")
        mc = (
            ((body or {}).get("vllm_config") or {}).get("model_config")
            if st == 200 and isinstance(body, dict)
            else None
        )
        if isinstance(mc, dict):
            if dtype_name(mc.get("dtype")):
                found["dtype"], found["source"]["dtype"] = dtype_name(mc["dtype"]), "/server_info model_config.dtype"
            if mc.get("logprobs_mode") in LOGPROBS_MODES:
                found["logprobs_mode"] = mc["logprobs_mode"]
                found["source"]["logprobs_mode"] = "/server_info model_config.logprobs_mode"
    elif dialect == "sglang":
        # /server_info; /get_server_info is its deprecated alias (a warning in the server's log each
        # call), the only name of older versions (sglang/srt/entrypoints/http_server.py, 0.5.23).
        for route in ("/server_info", "/get_server_info"):
            st, body, _ = await _get(session, base + route)
            if st == 200 and isinstance(body, dict):
                if dtype_name(body.get("dtype")):
                    found["dtype"], found["source"]["dtype"] = dtype_name(body["dtype"]), f"{route} dtype"
                break
    elif dialect == "llamacpp" or "ftype" in meta:
        # llama.cpp's /v1/models data[0].meta.ftype: "all F32", "BF16", "F16", or a quantized type
        # ("Q8_0", "Q4_K - Medium"; tools/server/server.cpp, llama_model_ftype_name).
        ftype = meta.get("ftype")
        if dtype_name(ftype):
            found["dtype"], found["source"]["dtype"] = dtype_name(ftype), f"/v1/models meta.ftype {ftype!r}"
        elif dtypes.quantized(ftype):
            found["quantized"] = dtypes.quantized(ftype)
            found["source"]["quantized"] = f"/v1/models meta.ftype {ftype!r}"
    elif dialect == "tgi":
        st, body, _ = await _get(session, base + "/info")
        if st == 200 and isinstance(body, dict) and dtype_name(body.get("model_dtype")):
            found["dtype"], found["source"]["dtype"] = dtype_name(body["model_dtype"]), "/info model_dtype"
    return found


def resolve_dtype(label: str | None, run_meta_label: str | None, found: dict) -> tuple[str | None, str]:
    """(dtype, where it came from). The engine's report wins; a label that contradicts it is an
    error (one of the two is wrong, and the classifier's grid depends on it)."""
    labels = {dtypes.get(x, "--dtype").name for x in (label, run_meta_label) if x}
    if len(labels) > 1:
        raise ConfigError(f"--dtype {label} and --run-meta dtype={run_meta_label} disagree; give one")
    given = labels.pop() if labels else None
    engine = found.get("dtype")
    if engine and given and engine != given:
        raise ConfigError(
            f"--dtype {given}: the engine reports {engine} ({found['source']['dtype']}); "
            "drop --dtype or fix the engine's configuration"
        )
    if engine:
        return engine, f"engine: {found['source']['dtype']}"
    if given:
        return given, "--dtype" if label else "--run-meta dtype"
    if found.get("quantized"):
        return None, (
            f"quantized: the engine reports {found['quantized']} ({found['source']['quantized']}); its logits "
            "lie on no float grid: judge the run with `tracekit calibrate` and --calibration"
        )
    return None, "unknown: the engine does not report it; pass --dtype fp32|bf16|fp16"


def resolve_logprobs_mode(option: str, found: dict) -> tuple[str, str]:
    """(mode, where it came from); --logprobs-mode other than auto wins, else the engine's report."""
    if option != "auto":
        if option not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode {option!r}: expected auto or one of {', '.join(LOGPROBS_MODES)}")
        engine = found.get("logprobs_mode")
        if engine and engine != option:
            raise ConfigError(
                f"--logprobs-mode {option}: the engine reports {engine} ({found['source']['logprobs_mode']})"
            )
        return option, "--logprobs-mode"
    if found.get("logprobs_mode"):
        return found["logprobs_mode"], f"engine: {found['source']['logprobs_mode']}"
    return "raw_logprobs", "default (the engine does not report it; vLLM's default)"


def sampling(specs: list[RequestSpec], stream: bool) -> dict:
    """The effective sampling of the planned requests: one value each, or the sorted distinct
    values when prompts set their own."""

    def one(values):
        vs = sorted(set(values))
        return vs[0] if len(vs) == 1 else vs

    return {
        "max_tokens": one(s.max_tokens for s in specs),
        "top_logprobs": one(s.top_logprobs for s in specs),
        "ignore_eos": one(s.ignore_eos for s in specs),
        "temperature": one(s.temperature for s in specs),
        "stream": stream,
    }


# The parts of a run that every row of one trace must share (issue 15): resuming with another
# value would mix runs under one run metadata.
RESUME_KEYS = ("prompts.sha256", "dialect", "sampling", "concurrency", "repeat", "arrival", "logprobs_mode", "dtype")


_ABSENT = object()  # a part an older trace's metadata does not have: not compared


def _part(run: dict, dotted: str):
    v: Any = run
    for k in dotted.split("."):
        v = v.get(k, _ABSENT) if isinstance(v, dict) else _ABSENT
    return v


def _shown(v) -> str:
    return repr(v[:12] + "...") if isinstance(v, str) and len(v) == 64 else repr(v)  # a sha256: its start


def check_resumable(path: str, old: dict, new: dict) -> None:
    """Refuse to complete a trace whose run differs from this one in any RESUME_KEYS part."""
    diffs = [
        f"{k} {_shown(_part(old, k))} -> {_shown(_part(new, k))}"
        for k in RESUME_KEYS
        if _part(old, k) is not _ABSENT and _part(old, k) != _part(new, k)
    ]
    if diffs:
        raise ConfigError(
            f"{path}: cannot --resume with another configuration ({'; '.join(diffs)}); "
            "rerun with the trace's own options, or write a new --out"
        )


# Where each dialect's cached-prompt count comes from (recorded in the run metadata).
_USAGE_CACHED = "usage.prompt_tokens_details.cached_tokens"
CACHE_FIELD = {
    "openai": _USAGE_CACHED,
    "openai-chat": _USAGE_CACHED,
    "vllm": _USAGE_CACHED + " (only with --enable-prompt-tokens-details)",
    "sglang": "meta_info.cached_tokens",
    "tgi": "not reported",
    "llamacpp": "timings.cache_n",
}


def _token_ids_note(dialect: str, tokenizer: str | None) -> tuple[str, bool]:
    """(where ids come from, whether token strings would stay unknown) for the run metadata."""
    if dialect not in ("openai", "openai-chat"):
        return "engine ids", False
    if tokenizer:
        return f"engine ids where sent; token strings mapped with the tokenizer at {tokenizer}", False
    return "engine ids where sent; token strings stay unknown (-1): no --tokenizer", True


def _cache_label(cfg, dialect: str) -> str:
    """The run's cache label: --run-meta cache=..., else what a llama.cpp cache_prompt asked."""
    if "cache" in cfg.run_meta:
        return cfg.run_meta["cache"]
    asked = cfg.cache_prompt
    if dialect == "llamacpp" and asked is not None:
        return "on" if asked else "off"
    return "unknown"


def build(cfg, pr, specs: list[RequestSpec], n_prompts: int, rate: float | None, numerics: dict) -> dict:
    """The run metadata of a capture as it starts (cfg: http.CaptureConfig, pr: the probe's
    result); the run adds `prompt_ids`, `pitfalls` and, at close, `prefix_cache_counters`."""
    # The engine's own report first, else the ids given (a matrix target's eos_token_ids), else the
    # files of the tokenizer directory (never guessed).
    tok_dir = cfg.tokenizer or (pr.tokenizer if pr.tokenizer and Path(pr.tokenizer).is_dir() else None)
    eos = pr.eos_token_ids or list(cfg.eos_token_ids) or (list(eos_token_ids(tok_dir)) if tok_dir else [])
    dtype, dtype_source = resolve_dtype(cfg.dtype, cfg.run_meta.get("dtype"), numerics)
    lp_mode, mode_source = resolve_logprobs_mode(cfg.logprobs_mode, numerics)
    ids_from, unmapped = _token_ids_note(pr.dialect, cfg.tokenizer)
    labels = {k: v for k, v in cfg.run_meta.items() if k not in ("cache", "dtype")}
    mode = labels.pop("mode", None)
    rest = base_run(
        dialect_reason=pr.reason,
        token_ids=ids_from,
        token_ids_unmapped=unmapped,
        arrival=cfg.arrival if rate is None else {"poisson_rate_per_s": rate, "seed": cfg.seed},
        repeat=cfg.repeat,
        timeout_s=cfg.timeout_s,
        prompts={"path": cfg.prompts, "sha256": sha256_file(cfg.prompts), "n": n_prompts},
        # llama.cpp's per-request switch as sent: true / false, or "not sent" (the server decides)
        cache_prompt="not sent" if cfg.cache_prompt is None else cfg.cache_prompt,
        **labels,
    )
    return RunRecord(
        target=cfg.url,
        dialect=pr.dialect,
        engine=EngineReport(pr.engine or {}),
        engine_family=pr.engine_kind or None,  # vllm, sglang, tgi, llamacpp, tracekit, ...: what `diff` compares
        model=cfg.model or pr.model,
        tokenizer=cfg.tokenizer or pr.tokenizer or None,
        eos_token_ids=tuple(eos),
        dtype=DTypeLabel(dtype, dtype_source),
        logprobs_mode=lp_mode,
        logprobs_mode_source=mode_source,
        concurrency=cfg.concurrency,
        sampling=sampling(specs, cfg.stream),
        cache=CacheFacts(_cache_label(cfg, pr.dialect), CACHE_FIELD.get(pr.dialect, "unknown")),
        mode=mode,
        extra={k: v for k, v in rest.items() if k != "run_version"},
    ).to_json()
