"""`tracekit capture`: record a trace, over HTTP (`--http URL`), by teacher forcing a local
model (`--teacher-forced MODEL`), or by replaying a trace's tokens through the engine under test
over HTTP (`--replay-http URL --from TRACE`). Exactly one of the three.

The command only parses options (declared in capture_options.py) and dispatches: `tracekit.capture.http.run_capture`
for HTTP, `tracekit.capture.teacher.run_teacher` (on a `TeacherConfig`) for teacher
forcing. Every option is declared once, in OPTIONS, with the mode it belongs to; an
option of one mode given in the other is a usage error. Exit codes: 0 every request ok, 1 some request failed
(the trace still holds its row), 2 usage, 3 tool error, 130 interrupted.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from .capture_options import (
    HTTP,
    OPTIONS,
    REPLAY,
    REPLAY_HISTORY,
    TEACHER,
    TEACHER_DTYPE,
    TEACHER_MAX_TOKENS,
    with_options,
)

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
@with_options
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
