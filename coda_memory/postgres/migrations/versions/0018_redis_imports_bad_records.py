"""The import ledger counts the records each identity's copy left out.

A run stopped after some identities were copied (a kill, Ctrl-C, a store gone) listed
their bad records only on the way out, if at all, and the next run skips those
identities: what they left out was never reported again. With the count in the ledger,
a later run says how many records earlier runs left out (``--dry-run`` lists them).

Adding a column with a constant default rewrites nothing: the lock it takes on
``redis_imports``, which only imports write, is brief.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from coda_memory.postgres.views import migrating_schema

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # (An ALTER TABLE names its schema as given: the configured one, not translated.)
    op.add_column(
        "redis_imports",
        sa.Column("bad_records", sa.Integer(), nullable=False, server_default="0"),
        schema=migrating_schema(op.get_context()),
    )


def downgrade() -> None:
    op.drop_column("redis_imports", "bad_records", schema=migrating_schema(op.get_context()))
