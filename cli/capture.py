"""`tracekit capture`: record a trace, over HTTP (`--http URL`), by teacher forcing a local
model (`--teacher-forced MODEL`), or by replaying a trace's tokens through the engine under test
over HTTP (`--replay-http URL --from TRACE`). Exactly one of the three.

The command only parses options and dispatches: `tracekit.capture.http.run_capture`
for HTTP, `tracekit.capture.teacher.run_teacher` (on a `TeacherConfig`) for teacher
forcing. Every option is declared once, in OPTIONS, with the mode it belongs to; an
option of one mode given in the other is a usage error. Exit codes: 0 every request ok, 1 some request failed
(the trace still holds its row), 2 usage, 3 tool error, 130 interrupted.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

EPILOG = """Examples:

\b
  tracekit capture --http http://127.0.0.1:8000 --prompts fixtures/prompts/cpu_small.jsonl \\
      --out serial.h5 --concurrency 1
  tracekit capture --http http://127.0.0.1:8000 --prompts fixtures/prompts/cpu_small.jsonl \\
      --out concurrent.h5 --concurrency 16 && tracekit diff serial.h5 concurrent.h5
  tracekit capture --teacher-forced fixtures/models/tiny --from serial.h5 \\
      --history full,prefix:auto,decode --dtype fp32,bf16 --out diag.h5
  tracekit capture --teacher-forced fixtures/models/tiny --from serial.h5 --tp 2 --out diag_tp2.h5
  tracekit capture --replay-http http://127.0.0.1:8000 --from serial.h5 \\
      --history cold,warm:auto --out engine_replay.h5
"""

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


def _with_options(f):
    for o in reversed(OPTIONS):
        kw = dict(o.kw)
        if o.mode not in (BOTH, ALL) and not isinstance(o.mode, tuple):
            h = kw.get("help", "")
            first = h[:1] if h[1:2].isupper() else h[:1].lower()  # "SSE", "HTTP" stay as they are
            kw["help"] = f"{MODE_LABEL[o.mode]}: {first}{h[1:]}"
        f = click.option(*o.decls, **kw)(f)
    return f


@click.command(epilog=EPILOG)
@click.option("--http", "url", metavar="URL", help="Capture from the server at URL (e.g. http://127.0.0.1:8000).")
@click.option(
    "--replay-http",
    "replay_url",
    metavar="URL",
    help="Replay --from's traced tokens through the engine at URL, under each --history (docs/explain.md).",
)
@click.option(
    "--teacher-forced",
    "teacher_model",
    metavar="MODEL",
    help="Teacher-forced diagnostic on a local HF model directory (see docs/diagnostic.md).",
)
@_with_options
@click.pass_context
def cmd(ctx, url, teacher_model, replay_url, **opts):
    """Capture a trace from an engine over HTTP, teacher-forced from a model, or replayed through the engine."""
    if sum(map(bool, (url, teacher_model, replay_url))) != 1:
        raise click.UsageError("give exactly one of --http URL, --teacher-forced MODEL or --replay-http URL")
    mode = HTTP if url else TEACHER if teacher_model else REPLAY
    _only_for(ctx, mode)
    mine = {o.name: opts[o.name] for o in OPTIONS if o.takes(mode)}
    as_json = mine.pop("as_json")
    if mode == REPLAY:
        from click.core import ParameterSource

        if ctx.get_parameter_source("history") != ParameterSource.COMMANDLINE:
            mine["history"] = REPLAY_HISTORY
        ctx.exit(_run_replay(replay_url, as_json, mine))
    ctx.exit(_run_http(url, as_json, mine) if url else _run_teacher(teacher_model, as_json, mine))


def _only_for(ctx, mode: str) -> None:
    """Options of the other mode given on the command line: a usage error, never silently ignored."""
    from click.core import ParameterSource

    other = [o for o in OPTIONS if not o.takes(mode)]
    given = [o for o in other if ctx.get_parameter_source(o.name) == ParameterSource.COMMANDLINE]
    if given:
        where = " or ".join(m for m in (HTTP, TEACHER, REPLAY) if given[0].takes(m))
        raise click.UsageError(f"{', '.join(o.flag for o in given)}: only with {where}")


def _run_replay(url: str, as_json: bool, opts: dict) -> int:
    import os

    from tracekit.capture.replay_http import ReplayHttpConfig, parse_histories, run_replay_http
    from tracekit.errors import ConfigError

    for need, flag in (("from_path", "--from"), ("out", "--out")):
        if not opts.get(need):
            raise click.UsageError(f"--replay-http needs {flag}")
    api_key = os.environ.get(opts["api_key_env"]) if opts.get("api_key_env") else None
    try:
        histories = parse_histories(opts["history"])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    cfg = ReplayHttpConfig(
        url=url,
        source=opts["from_path"],
        out=opts["out"],
        histories=histories,
        keys=tuple(k for k in (opts.get("keys") or "").split(",") if k),
        top_logprobs=opts["top_logprobs"],
        engine=opts["replay_engine"],
        method=opts["replay_method"],
        timeout_s=opts["timeout_s"],
        api_key=api_key,
        tokenizer=opts.get("tokenizer"),
    )
    s = run_replay_http(cfg)
    if as_json:
        click.echo(json.dumps(s.as_dict(), sort_keys=True))
    else:
        click.echo(f"{s.out}: {s.ok}/{s.rows} replay rows ok on {s.engine} ({s.method})")
    for line in s.skipped[:5]:
        click.echo(f"skipped: {line}", err=True)
    for line in s.failed[:5]:
        click.echo(f"failed: {line}", err=True)
    return 1 if s.failed else 0


def _run_teacher(model: str, as_json: bool, opts: dict) -> int:
    from tracekit.capture.teacher import TeacherConfig, run_teacher

    opts["max_tokens"] = opts["max_tokens"] if opts["max_tokens"] is not None else TEACHER_MAX_TOKENS
    opts["dtype"] = opts["dtype"] or TEACHER_DTYPE
    s = run_teacher(TeacherConfig(model_dir=model, **opts))
    if as_json:
        click.echo(json.dumps(s.as_dict(), sort_keys=True))
    else:
        click.echo(
            f"{s.path}: {s.rows} teacher-forced rows ({s.sequences} sequences x histories x dtypes); "
            + ", ".join(f"{d} {t:.1f}s" for d, t in s.seconds_by_dtype.items())
        )
    if s.skipped:
        click.echo(
            f"note: {len(s.skipped)} (sequence, history) pairs did not apply and have no row (key history (why)): "
            + ", ".join(s.skipped[:5])
            + (" ..." if len(s.skipped) > 5 else ""),
            err=True,
        )
    return 0


def _run_http(url: str, as_json: bool, opts: dict) -> int:
    from tracekit.capture.http import CaptureConfig, run_capture
    from tracekit.text import clip

    for need in ("prompts", "out"):
        if not opts.get(need):
            raise click.UsageError(f"--http needs --{need}")
    try:
        s = run_capture(CaptureConfig(url=url, **opts))
    except KeyboardInterrupt:
        _interrupted(opts["out"])
        return 130
    if as_json:
        click.echo(json.dumps(s.as_dict(), sort_keys=True))
    else:
        c = s.trace_counts  # every row of the trace: a resume's kept rows count too
        sent = f"{s.kept} kept from --resume, {s.planned - s.kept} sent now; " if s.kept else ""
        click.echo(
            f"{s.out}: {c['ok']}/{s.planned} ok, {c['error']} error, {c['timeout']} timeout, "
            f"{c['cancelled']} cancelled ({sent}{s.tokens} tokens sent in {s.wall_s:.1f}s); dialect {s.dialect}"
        )
        lat = s.latency
        if lat:
            click.echo(
                "  ".join(
                    f"{name[:-2]} p50 {v['p50'] * 1e3:.1f} ms, p99 {v['p99'] * 1e3:.1f} ms" for name, v in lat.items()
                )
            )
    for key, status, error in s.failures[:5]:  # the why, on stderr (stdout stays data)
        click.echo(f"failed: {key} ({status}): {clip(error, 200)}", err=True)
    if s.failed > 5:
        click.echo(f"... and {s.failed - 5} more failed requests (see the trace's error column)", err=True)
    return 1 if s.failed else 0


def _interrupted(out: str) -> None:
    """Ctrl-C: say what the trace holds and the command that completes the run."""
    args = sys.argv[1:] if sys.argv[1:2] == ["capture"] else ["capture", *sys.argv[1:]]
    again = "tracekit " + shlex.join(args + ([] if "--resume" in args else ["--resume"]))
    if Path(out).exists():
        click.echo(
            f"Interrupted: {out} keeps every finished request (in-flight ones as `cancelled` rows); "
            f"to complete the run: {again}",
            err=True,
        )
    else:
        click.echo("Interrupted before any request was written; nothing to resume.", err=True)
