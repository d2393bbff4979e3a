"""Ingest through a locked ``ingest_batches``: a second table for idempotency keys.

An append records its batch's key in ``ingest_batches``. A first attempt of a batch (no
earlier attempt of it can have been stored) that finds that table locked records its key
here instead, so that a lock on one of the two tables never stops ingest; a retry of a
batch whose outcome was lost looks in both (:mod:`coda_memory.postgres.batch_keys`).
Same columns, same expiry, no identity. The roles that ``coda-memory grant app`` granted
before (those that may insert into ``ingest_batches``) get the app's privileges on it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    op.create_table(
        "ingest_batches_spill",
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
        sa.PrimaryKeyConstraint("key", name=op.f("pk_ingest_batches_spill")),
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_ingest_batches_spill_committed_at"),
        "ingest_batches_spill",
        ["committed_at"],
        schema=SCHEMA,
    )
    # The app roles granted before this migration may use the new table at once.
    grant = tenancy_sql("grant_like", _schema(), "ingest_batches_spill", source="ingest_batches")
    op.execute(grant)


def downgrade() -> None:
    op.drop_table("ingest_batches_spill", schema=SCHEMA)
