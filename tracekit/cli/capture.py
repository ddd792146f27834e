"""`tracekit capture`: record a trace, over HTTP (`--http URL`) or by
teacher forcing a local model (`--teacher-forced MODEL`). Exactly one of the two.

The command only parses options and dispatches: `capture.capture_run.run_capture`
for HTTP, `capture.teacher.cli_run(**opts)` for teacher forcing. Exit codes:
0 every request ok, 1 some request failed (the trace still holds its row),
2 usage, 3 tool error.
"""

from __future__ import annotations

import json

import click

EPILOG = """Examples:

\b
  tracekit capture --http http://127.0.0.1:8000 --prompts fixtures/prompts/cpu_small.jsonl \\
      --out serial.h5 --concurrency 1
  tracekit capture --http http://127.0.0.1:8000 --prompts fixtures/prompts/cpu_small.jsonl \\
      --out concurrent.h5 --concurrency 16 && tracekit diff serial.h5 concurrent.h5
  tracekit capture --teacher-forced fixtures/models/tiny --from serial.h5 \\
      --history full,prefix:auto,decode --dtype fp32,bf16 --out diag.h5
"""


def _kv(ctx, param, values):
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE")
        out[k] = val
    return out


@click.command(epilog=EPILOG)
@click.option("--http", "url", metavar="URL", help="Capture from the server at URL (e.g. http://127.0.0.1:8000).")
@click.option(
    "--teacher-forced",
    "teacher_model",
    metavar="MODEL",
    help="Teacher-forced diagnostic on a local HF model directory (see docs/diagnostic.md).",
)
# ---- --http options --------------------------------------------------------
@click.option("--prompts", type=click.Path(dir_okay=False), help="JSONL prompt set (docs/capture.md).")
@click.option("--out", type=click.Path(dir_okay=False), help="Trace file to write (.h5).")
@click.option("--concurrency", default=1, show_default=True, help="Requests in flight at most.")
@click.option("--max-tokens", default=32, show_default=True, help="Tokens to generate per request.")
@click.option("--top-logprobs", default=20, show_default=True, help="Top-k logprobs to ask for and store.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (engines that support it).")
@click.option("--stream/--no-stream", default=True, show_default=True, help="SSE streaming (per-token times).")
@click.option(
    "--dialect",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "openai", "openai-chat", "vllm", "sglang", "tgi", "llamacpp"]),
    help="The server's wire format; auto probes and records why.",
)
@click.option("--tokenizer", type=click.Path(file_okay=False), help="Tokenizer dir, to map token strings to ids.")
@click.option("--model", default="", help="Model name to send (default: the first of /v1/models).")
@click.option(
    "--api-key-env", metavar="VAR", help="Read the API key from env VAR; sent as a Bearer header, never stored."
)
@click.option("--timeout-s", default=600.0, show_default=True, help="Per-request timeout in seconds.")
@click.option("--arrival", default="burst", show_default=True, help="burst | poisson:RATE (requests/s).")
@click.option("--seed", default=0, show_default=True, help="Seed of the Poisson arrivals.")
@click.option("--repeat", default=1, show_default=True, help="Send each prompt K times (keys get #r<k>).")
@click.option("--resume", is_flag=True, help="Keep the ok rows of --out and run only missing or failed keys.")
@click.option(
    "--run-meta",
    multiple=True,
    callback=_kv,
    metavar="KEY=VALUE",
    help="Extra labels for the run metadata (e.g. cache=on).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
# ---- --teacher-forced options (added by the teacher-forced helper) ---------
# TEACHER-FORCED OPTIONS: add `@click.option(...)` lines here; they reach
# `capture.teacher.cli_run(**opts)` through `teacher_opts` below.
@click.option(
    "--from",
    "from_path",
    type=click.Path(dir_okay=False),
    metavar="TRACE",
    help="Teacher-forced: replay the requests of this trace (prompt ids + generated ids).",
)
@click.option("--keys", metavar="K,...", help="Teacher-forced: only these request keys of --from.")
@click.option(
    "--history",
    default="full",
    show_default=True,
    metavar="H,...",
    help="Teacher-forced: cache histories, full,prefix:B,prefix:auto,chunked:C,decode.",
)
@click.option("--dtype", default="fp32", show_default=True, metavar="D,...", help="Teacher-forced: fp32,bf16,fp16.")
@click.option(
    "--attn",
    default="auto",
    show_default=True,
    type=click.Choice(["sdpa", "eager", "sdpa_lower_right", "auto"]),
    help="Teacher-forced: attention implementation; sdpa_lower_right keeps SDPA's flash kernel for "
    "cached segments on CUDA (bitwise sdpa on CPU); auto = sdpa_lower_right on CUDA, sdpa on CPU.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Teacher-forced: cpu, cuda[:N], or auto (device_map=auto over all GPUs).",
)
@click.option(
    "--no-cuda-graphs",
    is_flag=True,
    help="Teacher-forced: run decode steps eagerly on CUDA (default: CUDA graphs with eager attention, "
    "the same logits, ~2x faster).",
)
@click.option("--full-logits", is_flag=True, help="Teacher-forced: also store full-vocabulary logits.")
@click.option("--force", is_flag=True, help="Teacher-forced: write --full-logits even over 1 GB.")
@click.pass_context
def cmd(ctx, url, teacher_model, as_json, **opts):
    """Capture a trace from an engine over HTTP, or teacher-forced from a model."""
    if bool(url) == bool(teacher_model):
        raise click.UsageError("give exactly one of --http URL or --teacher-forced MODEL")
    if teacher_model:
        # ---- TEACHER-FORCED DISPATCH ----
        from capture import teacher

        _only_for(ctx, "--http", HTTP_ONLY)
        ctx.exit(teacher.cli_run(teacher_forced=teacher_model, as_json=as_json, **opts) or 0)
    _only_for(ctx, "--teacher-forced", TEACHER_ONLY)
    ctx.exit(_run_http(url, as_json, opts))


# Options of one mode given in the other: a usage error, not silently ignored.
HTTP_ONLY = (
    "concurrency",
    "ignore_eos",
    "stream",
    "dialect",
    "tokenizer",
    "model",
    "api_key_env",
    "timeout_s",
    "arrival",
    "seed",
    "repeat",
    "resume",
    "run_meta",
)
TEACHER_ONLY = ("from_path", "keys", "history", "dtype", "attn", "device", "full_logits", "force", "no_cuda_graphs")


def _only_for(ctx, mode: str, names: tuple[str, ...]) -> None:
    from click.core import ParameterSource

    given = [n for n in names if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + ("from" if n == "from_path" else n.replace("_", "-")) for n in given)
        raise click.UsageError(f"{flags}: only with {mode}")


HTTP_OPTIONS = (
    "prompts",
    "out",
    "concurrency",
    "max_tokens",
    "top_logprobs",
    "ignore_eos",
    "stream",
    "dialect",
    "tokenizer",
    "model",
    "api_key_env",
    "timeout_s",
    "arrival",
    "seed",
    "repeat",
    "resume",
    "run_meta",
)


def _run_http(url: str, as_json: bool, opts: dict) -> int:
    from capture.capture_run import CaptureConfig, run_capture

    for need in ("prompts", "out"):
        if not opts.get(need):
            raise click.UsageError(f"--http needs --{need}")
    cfg = CaptureConfig(url=url, **{k: opts[k] for k in HTTP_OPTIONS})
    s = run_capture(cfg)
    if as_json:
        click.echo(json.dumps(s.as_dict(), sort_keys=True))
    else:
        c = s.counts
        click.echo(
            f"{s.out}: {c['ok']}/{s.planned - s.kept} ok, {c['error']} error, {c['timeout']} timeout, "
            f"{c['cancelled']} cancelled ({s.kept} kept from --resume); {s.tokens} tokens in "
            f"{s.wall_s:.1f}s; dialect {s.dialect}"
        )
        lat = s.latency
        if lat:
            click.echo(
                "  ".join(
                    f"{name[:-2]} p50 {v['p50'] * 1e3:.1f} ms, p99 {v['p99'] * 1e3:.1f} ms" for name, v in lat.items()
                )
            )
    for key, status, error in s.failures[:5]:  # the why, on stderr (stdout stays data)
        click.echo(f"failed: {key} ({status}): {error[:200]}", err=True)
    if s.failed > 5:
        click.echo(f"... and {s.failed - 5} more failed requests (see the trace's error column)", err=True)
    return 1 if s.failed else 0
