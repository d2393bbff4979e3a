"""The Typer applications, the options the commands share, and the global ``--debug``."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from coda_memory.cli.runtime import invocation
from coda_memory.core.decay import AdaptiveDecay, DecayStrategy, ExponentialDecay

app = typer.Typer(
    name="coda-memory",
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


UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="CODA_MEMORY_DATABASE_URL",
        show_envvar=True,
        help="Postgres URL (postgresql://…). Default: the embedded Postgres in "
        "$CODA_MEMORY_DATA_DIR or ./.coda-memory/pgdata.",
    ),
]
SchemaOption = Annotated[
    str,
    typer.Option("--schema", envvar="CODA_MEMORY_SCHEMA", help="Schema of the tables."),
]
DecayOption = Annotated[
    DecayName,
    typer.Option(
        "--decay",
        envvar="CODA_MEMORY_DECAY",
        help="The decay strategy the agent server uses.",
    ),
]
FormatOption = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
PlotOption = Annotated[
    Path | None,
    typer.Option("--plot", help="Also draw a chart into this PNG file.", dir_okay=False),
]
IdentityArgument = Annotated[str, typer.Argument(help="The identity (user) id.")]


def decay_strategy(name: DecayName) -> DecayStrategy:
    """The strategy ``--decay`` names, with its default parameters."""
    return AdaptiveDecay() if name is DecayName.ADAPTIVE else ExponentialDecay()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
) -> None:
    """Memory across sessions for LLM agents: inspect and maintain it in Postgres.

    The database is --url or $CODA_MEMORY_DATABASE_URL; with neither, an embedded
    Postgres in ./.coda-memory/pgdata is created and migrated on first use.
    """
    invocation.debug = debug
