"""A k-anonymity floor in the analytics views, which only the owner may lower.

Until now the views held every group, one user's included, and ``min_users`` was applied
by the ``coda_memory.analytics`` functions and the CLI: an analyst role that ran its own
SQL on ``entity_popularity`` saw which entity one user had accessed, and on which days
one user asked about a domain (``domain_trends``). For a role that may not read the
``facts`` table (an analyst), the views now:

* leave out every row behind fewer identities than ``analytics_floor.min_users``
  (default 5), and withhold (NULL) a count of fewer identities in a row they keep
  (``affinity_users``, ``avoidance_users``, ``fact_users``; none stays 0), the mean
  confidence over them, and a bucket of ``fact_summary``'s histogram holding fewer
  facts;
* take no condition of the reader's below the floor: they are security barriers (no
  function of the reader's, such as a temporary one, every role may make those, and none
  that may fail on a value, as a division by zero does, runs on a hidden row), with an
  ``OFFSET 0`` on top that keeps out even the built-in comparisons, which the planner
  pushes below a barrier (``EXPLAIN ANALYZE`` then showed, by their "rows removed",
  which entity ids and domains the floor hid, and a comparison that fails under a
  nondeterministic collation told them too);
* decay facts to the start of the UTC day of the instant asked for (``analytics_window``)
  and round means to 2 places, so that stepping the instant cannot find when one user's
  fact expires, nor two days' exact means, one fact apart, give that fact's confidence.

For everyone, ``analytics_window.start_day`` is now counted in UTC: across a change of
daylight saving time in the session's time zone, a window began a day early or late.

A role that may read ``facts`` (the owner, an app role) reads single users' rows anyway:
the views hide nothing from it, as before (the view ``analytics_reader_floor`` decides).

``analytics_floor`` is one row that the owner changes with ``UPDATE``; no role is
granted it. A session setting would not do: any role may set its own.

The views are replaced in place (``analytics_window`` and ``domain_trends`` from 0002's
definitions, the others from 0012's): their columns, grants, owner and comments stay
(the comments are rewritten to say what the floor does). Downgrading puts those
definitions back (without the barrier), then drops the floor's view and table, with the
value an owner may have set: upgrading again starts from the default.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from coda_memory.postgres.sql import in_schema
from coda_memory.postgres.views import migrating_schema, replace_views, view_statements

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"

#: The floor a database gets (``schema.DEFAULT_ANALYTICS_FLOOR`` when this was written;
#: a migration keeps its own copy, so that it always does the same).
DEFAULT_FLOOR = 5

#: The views that apply the floor, and the revision of the definitions they replace
#: (analytics_window, which the others read, first).
VIEWS = {
    "analytics_window": "0002",
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
    replace_views(dict.fromkeys(VIEWS, revision))


def downgrade() -> None:
    schema = migrating_schema(op.get_context())
    # (CREATE OR REPLACE resets a view's options: no barrier, as before.)
    replace_views(VIEWS)
    op.execute(sa.text(in_schema("DROP VIEW {schema}.analytics_reader_floor", schema)))
    op.drop_table("analytics_floor", schema=SCHEMA)
