"""Rollup deferral: the appended transactions whose rollup is owed.

An append whose rollup tables are locked stores its observations anyway and records here,
per identity of the batch, its transaction id and which rollups it owes; a later append
(or ``coda-memory prune``) folds them in and deletes the record in one transaction
(:mod:`coda_memory.postgres.rollup_owed`).

The table holds identities, so it gets the row-level security of migration 0004: the
tenant (``forget`` deletes the identity's records), the owner's maintenance, and the
writer, which records and folds any identity's. Folding reads the observations of an
earlier transaction, so the writer also gets ``writer_owed_read`` on ``observations``:
the rows of the transaction named by ``coda_memory.rollup_xid``, which the folding sets.
The roles that ``coda-memory grant app`` granted before (those that may insert into
``ingest_batches``) get the app's privileges on the new table; the analyst role is
granted nothing here.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from coda_memory.postgres.schema import Xid8
from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    op.create_table(
        "rollup_owed",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("xid", Xid8(), nullable=False),
        sa.Column("kinds", sa.SmallInteger(), nullable=False),
        sa.Column(
            "owed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("identity_id", "xid", name=op.f("pk_rollup_owed")),
        schema=SCHEMA,
    )
    schema = _schema()
    frozen = ("tenant_policy_created_0004", "owner_policy_0004")
    for name in ("enable", *frozen, "writer_rollup_policy"):
        op.execute(tenancy_sql(name, schema, "rollup_owed"))
    op.execute(tenancy_sql("writer_owed_read_policy", schema, "observations"))
    # The app roles granted before this migration may use the new table at once.
    op.execute(tenancy_sql("grant_like", schema, "rollup_owed", source="ingest_batches"))


def downgrade() -> None:
    op.execute(f'DROP POLICY IF EXISTS writer_owed_read ON "{_schema()}".observations')
    op.drop_table("rollup_owed", schema=SCHEMA)
