"""The tenant must be given: a connection whose tenant setting is empty sees no row.

The ``tenant`` policy compared ``identity_id`` with ``current_setting(
'coda_memory.identity_id', true)``. A connection that never set it reads NULL and sees
nothing, but ``RESET coda_memory.identity_id`` (what the store runs after each read on a
pool that other work shares) leaves the setting empty, not missing: such a connection
saw, and could write, the rows of the empty identity. No store writes those any more
(they refuse a record with an empty identity), but a database may hold some written
before. The policy now compares with ``nullif(…, '')``, so an empty setting is no
identity at all.

The policies are altered in place on every table that has one (their names, roles and
the other policies stay). Downgrading puts 0004's expression back.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from coda_memory.postgres.tenancy import tenancy_sql
from coda_memory.postgres.views import migrating_schema

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The tables with a ``tenant`` policy: those of 0004, and ``rollup_owed`` (0006).
TENANT_TABLES = (
    "observations",
    "facts",
    "fact_events",
    "checkpoints",
    "tool_users",
    "entity_users",
    "domain_users",
    "redis_imports",
    "rollup_owed",
)


def upgrade() -> None:
    schema = migrating_schema(op.get_context())
    for table in TENANT_TABLES:
        op.execute(tenancy_sql("tenant_policy_given", schema, table))


def downgrade() -> None:
    schema = migrating_schema(op.get_context())
    for table in TENANT_TABLES:
        op.execute(tenancy_sql("tenant_policy_0004", schema, table))
