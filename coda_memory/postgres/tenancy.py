"""Tenant isolation in the database: the settings the policies read, and the grants.

Migration 0004 puts row-level security with ``FORCE`` on every per-identity table. The
policies read three settings, which the library sets per transaction:

* ``coda_memory.identity_id``: the identity a transaction works on (the tenant). The hot
  path, the reads and ``forget`` set it; a connection without it sees no row.
* ``coda_memory.writer = 'on'``: the background writer's append, whose batches mix
  identities: it may insert observations and upsert the rollup's per-identity rows of any
  identity, and read back only the observations its own transaction inserted (or, when
  it folds a rollup an earlier append owed, that transaction's: ``coda_memory.rollup_xid``
  names it; see :mod:`~coda_memory.postgres.rollup_owed`).
* ``coda_memory.all_identities = 'on'``: maintenance across identities. Only the role
  that ran the migrations (the owner) is allowed it; the command line sets it for its
  connections (:data:`ALL_IDENTITIES`), analytics for their transactions.

Three kinds of role (see the README's operations section): the owner, which migrates and
runs maintenance; ``app``, which the service runs as; ``analyst``, which reads the
aggregate views only. :func:`grant_script` gives the grants of ``app`` or ``analyst``.

Row-level security bounds what a statement of the service can reach: a query that forgot
its identity filter returns nothing instead of every tenant. Code that runs SQL of its
own choosing as the app role can set the settings too; that is what grants (no view, no
DDL) and the choice of role limit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Text, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from coda_memory.postgres.sql import query

#: The settings the policies read.
TENANT_SETTING = "coda_memory.identity_id"
WRITER_SETTING = "coda_memory.writer"
ALL_IDENTITIES_SETTING = "coda_memory.all_identities"
#: The owed transaction whose rows the writer folds into the rollup (migration 0006).
ROLLUP_XID_SETTING = "coda_memory.rollup_xid"

#: Server settings of a connection that works across identities (as the owner):
#: ``PostgresStore.from_url(url, connect_args={"server_settings": ALL_IDENTITIES})``.
ALL_IDENTITIES = {ALL_IDENTITIES_SETTING: "on"}

#: Sets the tenant for the current transaction (asyncpg's placeholder style).
SET_TENANT = f"SELECT set_config('{TENANT_SETTING}', $1, true)"
#: Sets the tenant for the session: for a statement run outside a transaction.
SET_TENANT_SESSION = f"SELECT set_config('{TENANT_SETTING}', $1, false)"
#: Clears the session's tenant (back to empty: no identity's rows).
CLEAR_TENANT_SESSION = f"RESET {TENANT_SETTING}"

#: The kinds of role ``coda-memory grant`` knows, and their grant scripts.
ROLE_KINDS = {"app": "grant_app", "analyst": "grant_analyst"}

_MAX_IDENTIFIER_BYTES = 63


def tenancy_sql(
    name: str,
    schema: str,
    table: str = "",
    source: str = "",
    privileges: str = "SELECT, INSERT, UPDATE, DELETE",
) -> str:
    """The DDL script ``sql/tenancy/name.sql`` for ``schema`` (validated), ``table``,
    ``source`` and ``privileges`` (this package's table names and privileges, constants).
    These scripts hold placeholders (``{table}``, ``{source}``, ``{privileges}``,
    ``{role}``) and, for the grants, several statements, so they live apart from the
    statements the library prepares."""
    text = query(f"tenancy/{name}", schema).text
    return (
        text.replace("{table}", table)
        .replace("{source}", source)
        .replace("{privileges}", privileges)
    )


def quote_role(name: str) -> str:
    """``name`` as a quoted SQL identifier, or ValueError for a name that can't be a role
    to grant to (empty, too long, a NUL, ``public`` or a reserved ``pg_`` name)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"invalid role name {name!r}")
    if len(name.encode("utf-8")) > _MAX_IDENTIFIER_BYTES:
        raise ValueError(f"invalid role name {name!r}: longer than 63 bytes")
    # Reserved as Postgres reserves them, case and all ("PG_x" and "Public" are roles).
    if name == "public" or name.startswith("pg_"):
        raise ValueError(f"invalid role name {name!r}: reserved")
    return '"' + name.replace('"', '""') + '"'


def grant_script(kind: str, role: str, schema: str) -> str:
    """The GRANT statements that make ``role`` a role of ``kind`` ('app' or 'analyst')
    on ``schema``, one per line group, ending in semicolons."""
    if kind not in ROLE_KINDS:
        raise ValueError(f"unknown kind of role {kind!r}: use one of {sorted(ROLE_KINDS)}")
    text = tenancy_sql(ROLE_KINDS[kind], schema)
    return text.replace("{role}", quote_role(role))


async def set_tenant(conn: AsyncConnection, identity_id: str) -> None:
    """Make ``identity_id`` the tenant of ``conn``'s transaction (beginning it)."""
    value = bindparam("identity_id", identity_id, Text)
    await conn.execute(select(func.set_config(TENANT_SETTING, value, True)))


async def set_all_identities(conn: AsyncConnection) -> None:
    """Ask for every identity's rows in ``conn``'s transaction (the owner only)."""
    await conn.execute(select(func.set_config(ALL_IDENTITIES_SETTING, "on", True)))


async def apply_grants(driver: Any, kind: str, role: str, schema: str) -> None:
    """Run :func:`grant_script` on an asyncpg connection, in one transaction."""
    async with driver.transaction():
        await driver.execute(grant_script(kind, role, schema))
