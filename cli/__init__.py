"""The `tracekit` command line: one thin module per command, loaded lazily.

Commands parse options, build a config, call the library and print. stdout
carries data only; logs and progress go to stderr. Exit codes: 0 ok,
1 divergence found / checks failed, 2 usage, 3 tool error (a TracekitError, or
an internal error: any other exception), 130 interrupted.

Exit 1 is a verdict, so no crash may ever exit 1: `main` turns every exception
into one `Error:` line and exit 3. The traceback of an internal error is shown
with `tracekit --debug ...` or TRACEKIT_DEBUG=1.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import click

from .. import __version__
from ..errors import TracekitError, UsageError

# command name -> module under tracekit.cli that defines a click command `cmd`.
# Lazy, so `tracekit diff` never imports torch or aiohttp.
COMMANDS = {
    "inspect": "inspect",
    "serve": "serve",
    "capture": "capture",
    "diff": "diff",
    "show": "show",
    "run": "run",
    "report": "report",
    "demo": "demo",
    "stats": "stats",
    "explain": "explain",
    "calibrate": "calibrate",
}


DEBUG_ENV = "TRACEKIT_DEBUG"
_debug = {"on": False}  # set by --debug (the group's callback runs before any command)


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        lazy = [name for name, mod in COMMANDS.items() if importlib.util.find_spec(f"{__name__}.{mod}")]
        return lazy + [name for name in super().list_commands(ctx) if name not in COMMANDS]

    def get_command(self, ctx, name):
        mod = COMMANDS.get(name)
        if mod is None:
            return super().get_command(ctx, name)  # commands added with @cli.command (plugins, tests)
        if importlib.util.find_spec(f"{__name__}.{mod}") is None:
            return None
        return importlib.import_module(f"{__name__}.{mod}").cmd


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Example: tracekit inspect fixtures/format/v1/reference.h5 --json",
)
@click.version_option(__version__, prog_name="tracekit")
@click.option("--debug", is_flag=True, help=f"Show the traceback of an internal error (or set {DEBUG_ENV}=1).")
def cli(debug: bool) -> None:
    """Differential trace and logit analysis for LLM serving engines."""
    _debug["on"] = _debug["on"] or debug


def _debugging() -> bool:
    return _debug["on"] or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> None:
    """Entry point: one error handler for the whole CLI."""
    try:
        rv = cli.main(args=argv, prog_name="tracekit", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:  # `tracekit` alone: the help, as click prints it
        click.echo(e.format_message(), err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:  # exit 2, one line that says where to look
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        click.echo(f"Error: {_one_line(e.format_message())}{hint}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:  # e.g. click.FileError: a tool error, whose click default (1) means "divergence"
        click.echo(f"Error: {_one_line(e.format_message())}", err=True)
        sys.exit(3)
    except UsageError as e:  # raised by the library on a bad option value: a usage error, exit 2
        if _debugging():
            traceback.print_exc()
        click.echo(f"Error: {_one_line(str(e))}", err=True)
        sys.exit(2)
    except TracekitError as e:
        if _debugging():
            traceback.print_exc()
        click.echo(f"Error: {e}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as e:  # a bug in tracekit, not a verdict: never exit 1
        sys.exit(_internal_error(e))
    sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _internal_error(e: Exception) -> int:
    """One `Error:` line for an exception tracekit did not expect (the traceback with --debug); exit 3."""
    if _debugging():
        traceback.print_exc()
    text = str(e).strip().splitlines()
    what = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    how = "traceback above" if _debugging() else f"rerun with `tracekit --debug ...` or {DEBUG_ENV}=1 for the traceback"
    click.echo(f"Error: internal error in tracekit ({what}); {how}, and please report it", err=True)
    return 3
