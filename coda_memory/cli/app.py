"""The Typer applications, the options the commands share, and the global ``--debug``."""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from coda_memory import __version__
from coda_memory.cli.runtime import (
    SCHEMA_VARIABLE,
    URL_VARIABLE,
    CliError,
    debug_enabled,
    invocation,
)
from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay, PowerLawDecay
from coda_memory.core.logs import set_log_key
from coda_memory.core.sanitize import MAX_IDENTITY_CHARS

DEBUG_FLAG = "--debug"
#: The key of the identity labels in log lines (``coda_memory.set_log_key``): the CLI's
#: warnings then label identities as the host's services do.
LOG_KEY_VARIABLE = "CODA_MEMORY_LOG_KEY"


def hoist_debug(args: Sequence[str]) -> list[str]:
    """``--debug`` anywhere before ``--`` moves to the front, where the callback reads it."""
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    rest = [a for a in args[:end] if a != DEBUG_FLAG] + args[end:]
    return [DEBUG_FLAG, *rest] if len(rest) < len(args) else rest


def _click_class(name: str) -> type[Exception]:
    """Click's exception classes, whether typer vendors click (0.2x) or uses the package."""
    found = next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
    return found


_ClickException = _click_class("ClickException")
_UsageError = _click_class("UsageError")


#: A paragraph line that starts a list item (``- ``, ``* ``, ``1. ``) or is indented:
#: the paragraph's line breaks are meant, and stay.
_LAID_OUT = re.compile(r"^(?:[-*] |\d+\. |\s)")


def unwrapped(text: str | None) -> str | None:
    """Help text with each paragraph's lines joined, so that the terminal wraps it at its
    own width: the docstrings are wrapped at the source's width, and typer's help keeps
    their line breaks (at 80 columns a sentence then broke in the middle of the line).
    Paragraphs that start with click's ``\\b`` or hold a list or indented lines stay as
    they are."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        paragraph
        if paragraph.startswith("\b")
        or any(_LAID_OUT.match(line) for line in paragraph.splitlines()[1:])
        else " ".join(line.strip() for line in paragraph.splitlines())
        for paragraph in paragraphs
    )


def _unwrap_help(command: Any) -> None:
    """:func:`unwrapped` on the help of ``command``, its options and its subcommands."""
    command.help = unwrapped(command.help)
    for param in command.params:
        if getattr(param, "help", None):
            param.help = unwrapped(param.help)
    for sub in getattr(command, "commands", {}).values():
        _unwrap_help(sub)


class _OneLineErrors(TyperGroup):
    """The root command: ``--debug`` anywhere, usage errors and a command's CliError
    (outside :func:`~coda_memory.cli.runtime.run` too) as one line on stderr, and help
    texts that the terminal wraps (:func:`unwrapped`)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        argv = hoist_debug(sys.argv[1:] if args is None else args)
        _unwrap_help(self)
        try:
            result = super().main(
                argv, prog_name, complete_var, False, windows_expand_args, **extra
            )
        except _ClickException as exc:
            if not standalone_mode:
                raise
            error: Any = exc
            if not error.format_message():  # no arguments: the help was the answer
                sys.exit(error.exit_code)
            hint = ""
            if isinstance(exc, _UsageError) and error.ctx is not None:
                hint = f" (see {error.ctx.command_path} --help)"
            typer.echo(f"error: {error.format_message()}{hint}", err=True)
            sys.exit(error.exit_code)
        except CliError as exc:
            if not standalone_mode or (debug_enabled() and exc.__cause__ is not None):
                raise
            typer.echo(f"error: {exc}", err=True)
            sys.exit(exc.code)
        except typer.Abort:
            if not standalone_mode:
                raise
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    name="coda-memory",
    cls=_OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
analytics_app = typer.Typer(
    help="Cross-user analytics: tools, entities, domains and facts.", no_args_is_help=True
)
app.add_typer(analytics_app, name="analytics")


class OutputFormat(StrEnum):
    """``--format`` of listings."""

    TABLE = "table"
    JSON = "json"


class AnalyticsFormat(StrEnum):
    """``--format`` of analytics, which can also be CSV."""

    TABLE = "table"
    JSON = "json"
    CSV = "csv"


class DecayName(StrEnum):
    """``--decay``: the strategy the agent server's MemoryService uses."""

    EXPONENTIAL = "exponential"
    ADAPTIVE = "adaptive"
    POWER_LAW = "power-law"


UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar=URL_VARIABLE,
        show_envvar=True,
        help="Postgres URL (postgresql://…). Default: the embedded Postgres in "
        "$CODA_MEMORY_DATA_DIR or ./.coda-memory/pgdata.",
    ),
]
SchemaOption = Annotated[
    str,
    typer.Option("--schema", envvar=SCHEMA_VARIABLE, help="Schema of the tables."),
]
DecayOption = Annotated[
    DecayName,
    typer.Option(
        "--decay",
        envvar="CODA_MEMORY_DECAY",
        help="The decay strategy the agent server uses.",
    ),
]
LockWaitOption = Annotated[
    str,
    typer.Option(
        "--lock-wait",
        help="How long to wait for a lock that another transaction holds (a migration, "
        "a LOCK TABLE) before giving up with exit 3.",
    ),
]
FormatOption = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
PlotOption = Annotated[
    Path | None,
    typer.Option("--plot", help="Also draw a chart into this PNG file.", dir_okay=False),
]


def _is_database_text(value: str) -> bool:
    """UTF-8 text (an argument that is not arrives with lone surrogates) without NUL."""
    return "\x00" not in value and not any("\ud800" <= c <= "\udfff" for c in value)


def checked_identity(value: str | None) -> str | None:
    """An identity argument that the database can take; a usage error otherwise."""
    if value == "":
        # No service stores one (it rejects an empty id): nothing to show or erase.
        raise typer.BadParameter("an identity is not empty")
    if value is not None and not _is_database_text(value):
        raise typer.BadParameter("an identity must be UTF-8 text without NUL")
    if value is not None and len(value) > MAX_IDENTITY_CHARS:
        # None is stored (the service and the import refuse them), and the message
        # would echo all of it.
        raise typer.BadParameter(f"an identity is at most {MAX_IDENTITY_CHARS} characters")
    return value


def checked_subject(value: str | None) -> str | None:
    """A fact's subject argument that the database can take; a usage error otherwise."""
    if value is not None and not _is_database_text(value):
        raise typer.BadParameter("a subject must be UTF-8 text without NUL")
    return value


IdentityArgument = Annotated[
    str, typer.Argument(help="The identity (user) id.", callback=checked_identity)
]


def decay_strategy(name: DecayName) -> DecayStrategy:
    """The strategy ``--decay`` names, with its default parameters."""
    if name is DecayName.ADAPTIVE:
        return AdaptiveDecay()
    if name is DecayName.POWER_LAW:
        return PowerLawDecay()
    return ExponentialDecay()


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"coda-memory {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option(DEBUG_FLAG, help="Show tracebacks of errors (anywhere on the line).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print coda-memory's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
) -> None:
    """Memory across sessions for LLM agents: inspect and maintain it in Postgres.

    The database is --url or $CODA_MEMORY_DATABASE_URL; with neither, an embedded
    Postgres in ./.coda-memory/pgdata is created and migrated on first use. Warnings
    label identities under the key in $CODA_MEMORY_LOG_KEY, as services given that key
    by set_log_key() do.
    """
    invocation.debug = debug
    log_to_stderr()
    key = os.environ.get(LOG_KEY_VARIABLE)
    if key:
        set_log_key(key)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The library's warnings on whatever ``sys.stderr`` is when they are logged, as one
    line each (what Python's last-resort handler printed before the library's logger
    had a handler of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it
        pass


def log_to_stderr() -> None:
    """Show the library's warnings on stderr during a command (once per process)."""
    logger = logging.getLogger("coda_memory")
    if not any(isinstance(handler, _Stderr) for handler in logger.handlers):
        logger.addHandler(_Stderr())
