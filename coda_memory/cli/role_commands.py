"""``coda-memory grant app|analyst ROLE``: the privileges of the service's and the
analysts' roles (see :mod:`coda_memory.postgres.tenancy` and the README's operations)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from coda_memory.cli.app import SchemaOption, UrlOption, app
from coda_memory.cli.runtime import (
    CliError,
    checked_schema,
    open_store,
    require_head,
    resolve_target,
    run,
)
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.schema import DEFAULT_SCHEMA
from coda_memory.postgres.tenancy import apply_grants, grant_script


class RoleKind(StrEnum):
    """What a role is for."""

    APP = "app"
    ANALYST = "analyst"


@app.command()
def grant(
    kind: Annotated[
        RoleKind,
        typer.Argument(
            help="app: the role the service runs as (one identity at a time; its writer "
            "inserts for any). analyst: the aggregate views only."
        ),
    ],
    role: Annotated[str, typer.Argument(help="An existing role (created by you).")],
    print_only: Annotated[
        bool, typer.Option("--print", help="Only print the statements, run nothing.")
    ] = False,
    url: UrlOption = None,
    schema: SchemaOption = DEFAULT_SCHEMA,
) -> None:
    """Grant ROLE what a role of its kind needs on the schema's tables and views.

    Run it as the owner (the role that migrates). The tables have row-level security:
    ROLE sees one identity at a time (app) or no table at all (analyst).
    """
    checked = checked_schema(schema)
    try:
        script = grant_script(kind.value, role, checked)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if print_only:
        # As it would run: echo drops what reads as a colour code when stdout is no
        # terminal, and a saved script then named another role.
        typer.echo(script, color=True)
        return

    async def main() -> None:
        target = resolve_target(url, schema)
        async with open_store(target) as store, store.engine.connect() as conn:
            # The script names the latest revision's tables: on an older schema it failed
            # on the first that was missing, with no word of migrating.
            await require_head(store, target, "grant")
            try:
                await apply_grants(await driver_connection(conn), kind.value, role, schema)
            except Exception as exc:
                raise CliError(f"could not grant {kind.value} to {role!r}: {exc}") from exc

    run(main, schema)
    typer.echo(f"granted {kind.value} to {role} on schema {schema}")
