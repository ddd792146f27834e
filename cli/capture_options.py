"""The options of `tracekit capture`, each declared once in OPTIONS with the mode it belongs to
(--http, --teacher-forced, --replay-http, or several); cli/capture.py applies them with
`with_options` and refuses an option of one mode given in another."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

HTTP, TEACHER, BOTH, REPLAY, ALL = "--http", "--teacher-forced", "both", "--replay-http", "all"
MODE_LABEL = {HTTP: "HTTP", TEACHER: "Teacher-forced", REPLAY: "Replay-HTTP"}
REPLAY_HISTORY = "cold,warm:auto"  # --history of --replay-http when not given
TEACHER_MAX_TOKENS = 32  # --max-tokens of a teacher-forced run when not given
TEACHER_DTYPE = "fp32"


def _kv(ctx, param, values):
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE")
        out[k] = val
    return out


@dataclass(frozen=True)
class Opt:
    """One option: its Python name, its flags, which mode takes it, click's settings."""

    name: str
    decls: tuple[str, ...]
    mode: str
    kw: dict = field(default_factory=dict)

    def takes(self, mode: str) -> bool:
        """Whether the option belongs to `mode` (BOTH: --http and --teacher-forced; ALL: every mode)."""
        modes = {BOTH: (HTTP, TEACHER), ALL: (HTTP, TEACHER, REPLAY)}.get(self.mode, None)
        if modes is None:
            modes = self.mode if isinstance(self.mode, tuple) else (self.mode,)
        return mode in modes

    @property
    def flag(self) -> str:
        return next(d for d in self.decls if d.startswith("--")).split("/")[0]


OPTIONS = (
    # ---- both modes ----------------------------------------------------------
    Opt(
        "prompts",
        ("--prompts",),
        BOTH,
        dict(type=click.Path(dir_okay=False), help="JSONL prompt set (docs/capture.md)."),
    ),
    Opt("out", ("--out",), ALL, dict(type=click.Path(dir_okay=False), help="Trace file to write (.h5).")),
    Opt(
        "max_tokens",
        ("--max-tokens",),
        BOTH,
        dict(
            type=int,
            help="Tokens to generate per request. HTTP: when given it wins over a prompt's own max_tokens "
            "(said on stderr); else the prompt's, else 32. Teacher-forced: for every prompt (default 32).",
        ),
    ),
    Opt(
        "top_logprobs",
        ("--top-logprobs",),
        ALL,
        dict(default=20, show_default=True, help="Top-k to ask for and store."),
    ),
    Opt(
        "dtype",
        ("--dtype",),
        BOTH,
        dict(
            metavar="D",
            help="HTTP: the dtype the engine runs (fp32|bf16|fp16), recorded as the run's `dtype` when the engine "
            "does not report it. Teacher-forced: dtypes to run, D,... of fp32,bf16,fp16 (default fp32).",
        ),
    ),
    Opt("as_json", ("--json", "as_json"), ALL, dict(is_flag=True, help="Print one JSON summary on stdout.")),
    # ---- --http ----------------------------------------------------------------
    Opt(
        "concurrency", ("--concurrency",), HTTP, dict(default=1, show_default=True, help="Requests in flight at most.")
    ),
    Opt(
        "ignore_eos",
        ("--ignore-eos/--no-ignore-eos",),
        HTTP,
        dict(default=None, help="Keep generating past EOS (engines that support it); default: the prompt's own."),
    ),
    Opt(
        "cache_prompt",
        ("--cache-prompt/--no-cache-prompt",),
        HTTP,
        dict(
            default=None,
            help="llama.cpp: send cache_prompt true/false with every request (prefix reuse on / a cold prompt). "
            "Default: not sent, so the server's own --cache-prompt / --no-cache-prompt decides.",
        ),
    ),
    Opt("stream", ("--stream/--no-stream",), HTTP, dict(default=True, show_default=True, help="SSE streaming.")),
    Opt(
        "dialect",
        ("--dialect",),
        HTTP,
        dict(
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "openai", "openai-chat", "vllm", "sglang", "tgi", "llamacpp"]),
            help="The server's wire format; auto probes and records why.",
        ),
    ),
    Opt(
        "logprobs_mode",
        ("--logprobs-mode",),
        HTTP,
        dict(
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]),
            help="What the engine's logprob fields hold (vLLM --logprobs-mode). *_logits: they are logits, "
            "stored as raw top-k logits; auto: what the engine reports, else raw_logprobs.",
        ),
    ),
    Opt(
        "tokenizer",
        ("--tokenizer",),
        (HTTP, REPLAY),
        dict(type=click.Path(file_okay=False), help="Tokenizer dir: token strings -> ids."),
    ),
    Opt("model", ("--model",), HTTP, dict(default="", help="Model name to send (default: the first of /v1/models).")),
    Opt(
        "api_key_env",
        ("--api-key-env",),
        (HTTP, REPLAY),
        dict(metavar="VAR", help="Read the API key from env VAR; sent as a Bearer header, never stored."),
    ),
    Opt(
        "timeout_s",
        ("--timeout-s",),
        (HTTP, REPLAY),
        dict(default=600.0, show_default=True, help="Per-request timeout (s)."),
    ),
    Opt(
        "wait_ready_s",
        ("--wait-ready", "wait_ready_s"),
        HTTP,
        dict(default=0.0, show_default=True, metavar="S", help="Wait up to S s for an engine still loading (503)."),
    ),
    Opt(
        "arrival", ("--arrival",), HTTP, dict(default="burst", show_default=True, help="burst | poisson:RATE (req/s).")
    ),
    Opt("seed", ("--seed",), HTTP, dict(default=0, show_default=True, help="Seed of the Poisson arrivals.")),
    Opt(
        "repeat", ("--repeat",), HTTP, dict(default=1, show_default=True, help="Send each prompt K times (keys #r<k>).")
    ),
    Opt(
        "resume",
        ("--resume",),
        HTTP,
        dict(
            is_flag=True, help="Keep the ok rows of --out (same configuration only) and run the missing or failed keys."
        ),
    ),
    Opt(
        "run_meta",
        ("--run-meta",),
        HTTP,
        dict(multiple=True, callback=_kv, metavar="KEY=VALUE", help="Extra labels for the run metadata (cache=on)."),
    ),
    # ---- --teacher-forced --------------------------------------------------------
    Opt(
        "from_path",
        ("--from", "from_path"),
        (TEACHER, REPLAY),
        dict(type=click.Path(dir_okay=False), metavar="TRACE", help="Replay the requests of this trace."),
    ),
    Opt("keys", ("--keys",), (TEACHER, REPLAY), dict(metavar="K,...", help="Only these request keys of --from.")),
    Opt(
        "history",
        ("--history",),
        (TEACHER, REPLAY),
        dict(
            default="full",
            show_default=True,
            metavar="H,...",
            help="Teacher-forced: full,prefix:B,prefix:auto,chunked:C,decode. Replay-HTTP: cold,warm:auto,warm:B "
            f"(default {REPLAY_HISTORY}).",
        ),
    ),
    # ---- --replay-http -----------------------------------------------------------
    Opt(
        "replay_engine",
        ("--replay-engine",),
        REPLAY,
        dict(
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "tracekit", "vllm", "sglang", "tgi", "llamacpp"]),
            help="Which engine the server is (its replay dialect); auto probes.",
        ),
    ),
    Opt(
        "replay_method",
        ("--replay-method",),
        REPLAY,
        dict(
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "forced", "prompt-logprobs"]),
            help="tracekit serve only: forced (the live decode path, default) or prompt-logprobs (one prefill).",
        ),
    ),
    Opt(
        "attn",
        ("--attn",),
        TEACHER,
        dict(
            default="auto",
            show_default=True,
            type=click.Choice(["sdpa", "eager", "sdpa_lower_right", "auto"]),
            help="Attention implementation; sdpa_lower_right keeps SDPA's flash kernel for cached segments on "
            "CUDA (bitwise sdpa on CPU); auto = sdpa_lower_right on CUDA, sdpa on CPU.",
        ),
    ),
    Opt(
        "device",
        ("--device",),
        TEACHER,
        dict(default="cpu", show_default=True, help="cpu, cuda[:N], or auto (device_map=auto over all GPUs)."),
    ),
    Opt(
        "no_cuda_graphs",
        ("--no-cuda-graphs",),
        TEACHER,
        dict(
            is_flag=True, help="Run decode steps eagerly on CUDA (default: CUDA graphs, the same logits, ~2x faster)."
        ),
    ),
    Opt(
        "no_prefix_reuse",
        ("--no-prefix-reuse",),
        TEACHER,
        dict(
            is_flag=True,
            help="Run every history's first segment itself (default: cut it from a longer one where the two "
            "were compared bitwise for that shape; the same logits).",
        ),
    ),
    Opt(
        "tp",
        ("--tp",),
        TEACHER,
        dict(
            default=1,
            show_default=True,
            type=int,
            metavar="N",
            help="Tensor-parallel size: run under transformers' own TP plan in N processes started here "
            "(rank r on cuda:r with --device cuda, else CPU); rank 0 writes the trace (docs/diagnostic.md).",
        ),
    ),
    Opt(
        "tp_backend",
        ("--tp-backend",),
        TEACHER,
        dict(
            type=click.Choice(["gloo", "nccl"]),
            help="torch.distributed backend of --tp N (default: nccl on CUDA, gloo on CPU); gloo on CUDA lets "
            "N ranks share fewer GPUs.",
        ),
    ),
    Opt("full_logits", ("--full-logits",), TEACHER, dict(is_flag=True, help="Also store full-vocabulary logits.")),
    Opt("force", ("--force",), TEACHER, dict(is_flag=True, help="Write --full-logits even over 1 GB.")),
)


def with_options(f):
    for o in reversed(OPTIONS):
        kw = dict(o.kw)
        if o.mode not in (BOTH, ALL) and not isinstance(o.mode, tuple):
            h = kw.get("help", "")
            first = h[:1] if h[1:2].isupper() else h[:1].lower()  # "SSE", "HTTP" stay as they are
            kw["help"] = f"{MODE_LABEL[o.mode]}: {first}{h[1:]}"
        f = click.option(*o.decls, **kw)(f)
    return f
