"""Rollup deferral: one folding reads the rows of many owed transactions.

The writer's policy ``writer_owed_read`` on ``observations`` (migration 0006) allowed the
rows of the one transaction that ``coda_memory.rollup_xid`` named, so folding owed
rollups took a savepoint and several statements per owed transaction: after a 10 s lock
on a rollup table, hundreds of them. The setting may now list several, comma-separated,
and the folding reads them all in one statement per kind of rollup
(:mod:`coda_memory.postgres.rollup_owed`). A single xid still reads as before.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from coda_memory.postgres.tenancy import tenancy_sql

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"


def _schema() -> str:
    return op.get_context().version_table_schema or SCHEMA


def upgrade() -> None:
    op.execute(tenancy_sql("writer_owed_read_many", _schema(), "observations"))


def downgrade() -> None:
    schema = _schema()
    op.execute(f'DROP POLICY IF EXISTS writer_owed_read ON "{schema}".observations')
    op.execute(tenancy_sql("writer_owed_read_policy", schema, "observations"))
