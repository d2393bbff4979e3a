"""Exactly-once ingest: the batches the writer has stored, by idempotency key.

Each append records its batch's key in the transaction that stores the batch; a retry of
a batch whose COMMIT was lost finds the key and stores nothing again. Keys carry no
identity and are deleted a day after their batch (:mod:`coda_memory.postgres.append`).
The roles that ``coda-memory grant app`` granted before (those that may insert into
``observations``) get the app's privileges on the new table: without them, every append
of a service running as such a role failed (and the migrations after this one, which
grant to the roles that may insert into ``ingest_batches``, granted nobody).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"


def upgrade() -> None:
    op.create_table(
        "ingest_batches",
        sa.Column("key", sa.Uuid(), nullable=False),
        sa.Column("stored", sa.Integer(), nullable=False),
        sa.Column(
            "refused", postgresql.JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False
        ),
        sa.Column(
            "committed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_ingest_batches")),
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_ingest_batches_committed_at"), "ingest_batches", ["committed_at"], schema=SCHEMA
    )
    schema = op.get_context().version_table_schema or SCHEMA
    op.execute(tenancy_sql("grant_like", schema, "ingest_batches", source="observations"))


def downgrade() -> None:
    op.drop_table("ingest_batches", schema=SCHEMA)
