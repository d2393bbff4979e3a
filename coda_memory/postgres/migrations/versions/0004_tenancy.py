"""Tenant isolation: row-level security on every per-identity table.

Every table with an ``identity_id`` column gets row-level security with ``FORCE`` (the
owner is subject to it too) and these policies (``coda_memory/postgres/sql/tenancy/``):

* ``tenant``: the rows of the identity set for the transaction
  (``coda_memory.identity_id``); without one, nothing;
* ``all_identities``: every row, for the role that ran this migration when it sets
  ``coda_memory.all_identities = 'on'`` (maintenance), and through its views to roles
  they are granted to (the aggregate views);
* ``writer_insert``/``writer_read`` (observations) and ``writer`` (the rollup's
  per-identity tables): the background writer's batches, which mix identities, in a
  transaction that set ``coda_memory.writer = 'on'``.

``coda-memory grant app|analyst ROLE`` grants what each kind of role needs; the README's
operations section explains the roles.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The default schema; env.py passes the configured one as the version table's schema.
SCHEMA = "coda_memory"

PER_IDENTITY = (
    "observations",
    "facts",
    "fact_events",
    "checkpoints",
    "tool_users",
    "entity_users",
    "domain_users",
    "redis_imports",
)
ROLLUP_USERS = ("tool_users", "entity_users", "domain_users")


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    schema = _schema()
    for table in PER_IDENTITY:
        for name in ("enable", "tenant_policy_created_0004", "owner_policy_0004"):
            op.execute(tenancy_sql(name, schema, table))
    op.execute(tenancy_sql("writer_insert_policy", schema, "observations"))
    op.execute(tenancy_sql("writer_read_policy", schema, "observations"))
    for table in ROLLUP_USERS:
        op.execute(tenancy_sql("writer_rollup_policy", schema, table))


def downgrade() -> None:
    schema = _schema()
    policies = {table: ["tenant", "all_identities"] for table in PER_IDENTITY}
    policies["observations"] += ["writer_insert", "writer_read"]
    for table in ROLLUP_USERS:
        policies[table].append("writer")
    for table, names in policies.items():
        for name in names:
            op.execute(f'DROP POLICY IF EXISTS {name} ON "{schema}".{table}')
        op.execute(f'ALTER TABLE "{schema}".{table} NO FORCE ROW LEVEL SECURITY')
        op.execute(f'ALTER TABLE "{schema}".{table} DISABLE ROW LEVEL SECURITY')
