"""The `tracekit` command line: one thin module per command, loaded lazily.

Commands parse options, build a config, call the library and print. stdout
carries data only; logs and progress go to stderr. Exit codes: 0 ok,
1 divergence found / checks failed, 2 usage, 3 tool error.
"""

from __future__ import annotations

import importlib
import sys

import click

from .. import __version__
from ..errors import TracekitError

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
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for name, mod in COMMANDS.items() if importlib.util.find_spec(f"{__name__}.{mod}")]

    def get_command(self, ctx, name):
        mod = COMMANDS.get(name)
        if mod is None or importlib.util.find_spec(f"{__name__}.{mod}") is None:
            return None
        return importlib.import_module(f"{__name__}.{mod}").cmd


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Example: tracekit inspect fixtures/format/v1/reference.h5 --json",
)
@click.version_option(__version__, prog_name="tracekit")
def cli() -> None:
    """Differential trace and logit analysis for LLM serving engines."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: one error handler for the whole CLI."""
    try:
        rv = cli.main(args=argv, prog_name="tracekit", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as e:  # usage errors: exit 2
        e.show()
        sys.exit(e.exit_code)
    except TracekitError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
