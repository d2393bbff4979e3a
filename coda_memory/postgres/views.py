"""The analytics views' SQL, as each migration created them.

A view's SQL lives in ``migrations/views/<revision>/<view>.sql``, the revision that
created or changed it. A later revision that changes a view adds files of its own, so a
revision always builds the same views, and a downgrade can put back the ones before it.
``coda_memory.postgres.analytics`` describes what the views mean.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import sqlalchemy as sa
from alembic import op
from alembic.runtime.migration import MigrationContext

from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name
from coda_memory.postgres.sql import in_schema, strip_comments

#: One directory per revision that created or changed views.
VIEW_SQL = Path(__file__).resolve().parent / "migrations" / "views"

#: The end of a statement in a view's file (a view, then its comment).
_STATEMENT_END = re.compile(r";\s*$", re.MULTILINE)
_CREATE = "CREATE VIEW "


def view_statements(revision: str, name: str, schema: str, *, replace: bool = False) -> list[str]:
    """The statements of ``name``'s file in ``revision`` for ``schema`` (validated).

    ``replace``: a ``CREATE VIEW`` becomes ``CREATE OR REPLACE VIEW``, which keeps the
    view's grants, owner and comment (a downgrade puts an earlier definition back so)."""
    source = (VIEW_SQL / revision / f"{name}.sql").read_text(encoding="utf-8")
    sql = in_schema(strip_comments(source), schema)
    if replace:
        sql = sql.replace(_CREATE, "CREATE OR REPLACE VIEW ")
    return [statement.strip() for statement in _STATEMENT_END.split(sql) if statement.strip()]


def migrating_schema(context: MigrationContext) -> str:
    """The schema a migration runs in: env.py's ``schema_translate_map`` moves the
    migrations' ``coda_memory`` there (offline, ``--sql``, it names the version table's)."""
    if context.as_sql:
        return validate_schema_name(context.version_table_schema or DEFAULT_SCHEMA)
    assert context.connection is not None  # online: alembic gave the migration a connection
    translate = context.connection.get_execution_options().get("schema_translate_map") or {}
    return validate_schema_name(translate.get(DEFAULT_SCHEMA, DEFAULT_SCHEMA))


def replace_views(definitions: Mapping[str, str]) -> None:
    """In a migration: replace each view named in ``definitions`` in place with its
    definition of the revision given for it (``CREATE OR REPLACE``: its grants, owner and
    comment stay), in the schema the migration runs in, in order."""
    schema = migrating_schema(op.get_context())
    for name, revision in definitions.items():
        for statement in view_statements(revision, name, schema, replace=True):
            op.execute(sa.text(statement))
