"""The ledger of identities copied from the original Redis layout (coda-memory import-redis).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"


def upgrade() -> None:
    # A new, empty table: creating it takes no lock that live traffic waits on.
    op.create_table(
        "redis_imports",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("imported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("observations", sa.Integer(), nullable=False),
        sa.Column("consumed_observations", sa.Integer(), nullable=False),
        sa.Column("facts", sa.Integer(), nullable=False),
        sa.Column("fact_events", sa.Integer(), nullable=False),
        sa.Column("checkpoint_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("identity_id", "source", name=op.f("pk_redis_imports")),
        schema=SCHEMA,
    )
    # Upgrading again after a downgrade below 0003: the app roles keep their grants on
    # the tables that stayed, and get this one's as 0005 onward give theirs.
    schema = op.get_context().version_table_schema or SCHEMA
    grant = tenancy_sql(
        "grant_like", schema, "redis_imports", source="observations", privileges="SELECT, DELETE"
    )
    op.execute(grant)


def downgrade() -> None:
    op.drop_table("redis_imports", schema=SCHEMA)
