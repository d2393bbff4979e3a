"""A k-anonymity floor in the analytics views, which only the owner may lower.

Until now the views held every group, one user's included, and ``min_users`` was applied
by the ``coda_memory.analytics`` functions and the CLI: an analyst role that ran its own
SQL on ``entity_popularity`` saw which entity one user had accessed, and on which days
one user asked about a domain (``domain_trends``). The views now leave out, for a role
that may not read the ``facts`` table (an analyst), every row behind fewer identities
than ``analytics_floor.min_users`` (default 5), and withhold a mean confidence over fewer
(NULL). A role that may read ``facts`` (the owner, an app role) reads single users' rows
anyway: the views hide nothing from it, as before (the view ``analytics_reader_floor``
decides).

``analytics_floor`` is one row that the owner changes with ``UPDATE``; no role is
granted it. A session setting would not do: any role may set its own.

The four views become security barriers: otherwise the planner runs a reader's own
function in a WHERE clause (a temporary one: every role may make those), or an
expression that fails on one value (a division by zero), on the rows below the floor
before the floor leaves them out, and the function, or the error, tells them.

``tool_effectiveness``, ``entity_popularity`` and ``fact_summary`` are replaced in place
from 0012's definitions, ``domain_trends`` from 0002's: their columns, grants, owner and
comments stay (the comments are rewritten to say what the floor does). Downgrading puts
those definitions back (without the barrier), then drops the floor's view and table.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from coda_memory.postgres.sql import in_schema
from coda_memory.postgres.views import migrating_schema, view_statements

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"

#: The floor a database gets (``schema.DEFAULT_ANALYTICS_FLOOR`` when this was written;
#: a migration keeps its own copy, so that it always does the same).
DEFAULT_FLOOR = 5

#: The views that apply the floor, and the revision of the definitions they replace.
VIEWS = {
    "tool_effectiveness": "0012",
    "entity_popularity": "0012",
    "domain_trends": "0002",
    "fact_summary": "0012",
}


def upgrade() -> None:
    op.create_table(
        "analytics_floor",
        sa.Column("one_row", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column(
            "min_users", sa.Integer(), server_default=sa.text(str(DEFAULT_FLOOR)), nullable=False
        ),
        sa.CheckConstraint("one_row", name=op.f("ck_analytics_floor_one_row")),
        sa.CheckConstraint("min_users >= 1", name=op.f("ck_analytics_floor_min_users")),
        sa.PrimaryKeyConstraint("one_row", name=op.f("pk_analytics_floor")),
        schema=SCHEMA,
    )
    schema = migrating_schema(op.get_context())
    # The one row, of defaults (a statement without parameters, for the --sql output too).
    op.execute(sa.text(in_schema("INSERT INTO {schema}.analytics_floor DEFAULT VALUES", schema)))
    for statement in view_statements(revision, "analytics_reader_floor", schema):
        op.execute(sa.text(statement))
    for name in VIEWS:
        for statement in view_statements(revision, name, schema, replace=True):
            op.execute(sa.text(statement))


def downgrade() -> None:
    schema = migrating_schema(op.get_context())
    for name, source_revision in VIEWS.items():
        for statement in view_statements(source_revision, name, schema, replace=True):
            op.execute(sa.text(statement))
    op.execute(sa.text(in_schema("DROP VIEW {schema}.analytics_reader_floor", schema)))
    op.drop_table("analytics_floor", schema=SCHEMA)
