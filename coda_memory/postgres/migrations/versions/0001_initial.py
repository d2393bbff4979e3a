"""Observations, facts, fact events and checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateSchema

from coda_memory.postgres.schema import Xid8

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"

CATEGORIES = (
    "category IN ('tool_affinity', 'tool_avoidance', 'entity_frequency', "
    "'domain_preference', 'failure_pattern')"
)


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    target = op.get_context().version_table_schema or SCHEMA
    op.execute(CreateSchema(target, if_not_exists=True))

    # Names are final (op.f): the naming convention already produced them.
    # The tables are new and empty, so building their indexes inside the migration's
    # transaction holds no lock that live traffic waits on.
    op.create_table(
        "observations",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("xid", Xid8(), server_default=sa.text("pg_current_xact_id()"), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column(
            "metadata",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("session_id", sa.Text(), nullable=True),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("identity_id", "id", name=op.f("pk_observations")),
        sa.CheckConstraint(
            "type IN ('tool_success', 'tool_failure', 'entity_access', 'query_pattern')",
            name=op.f("ck_observations_type"),
        ),
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_observations_identity_id_xid"),
        "observations",
        ["identity_id", "xid"],
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_observations_identity_id_created_at"),
        "observations",
        ["identity_id", "created_at"],
        schema=SCHEMA,
    )

    op.create_table(
        "facts",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("confidence", sa.Double(), nullable=False),
        sa.Column("reinforcement_count", sa.Integer(), nullable=False),
        _timestamp("last_reinforced_at"),
        _timestamp("confidence_at"),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.Column("ease_factor", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("identity_id", "subject", name=op.f("pk_facts")),
        sa.CheckConstraint(CATEGORIES, name=op.f("ck_facts_category")),
        sa.CheckConstraint("confidence >= 0 AND confidence <= 1", name=op.f("ck_facts_confidence")),
        sa.CheckConstraint("reinforcement_count >= 1", name=op.f("ck_facts_reinforcement_count")),
        schema=SCHEMA,
    )

    op.create_table(
        "fact_events",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=True),
        _timestamp("at"),
        sa.Column("confidence_before", sa.Double(), nullable=True),
        sa.Column("confidence_after", sa.Double(), nullable=True),
        sa.Column("count_before", sa.Integer(), nullable=True),
        sa.Column("count_after", sa.Integer(), nullable=True),
        sa.Column("ease_before", sa.Double(), nullable=True),
        sa.Column("ease_after", sa.Double(), nullable=True),
        sa.Column("quality", sa.Double(), nullable=True),
        sa.Column("hits", sa.Integer(), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        _timestamp("recorded_at"),
        sa.PrimaryKeyConstraint("identity_id", "id", name=op.f("pk_fact_events")),
        sa.CheckConstraint(CATEGORIES, name=op.f("ck_fact_events_category")),
        sa.CheckConstraint(
            "kind IN ('created', 'reinforced', 'extended', 'expired')",
            name=op.f("ck_fact_events_kind"),
        ),
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_fact_events_identity_id_subject_id"),
        "fact_events",
        ["identity_id", "subject", "id"],
        schema=SCHEMA,
    )
    op.create_index(
        op.f("ix_fact_events_identity_id_session_id"),
        "fact_events",
        ["identity_id", "session_id"],
        schema=SCHEMA,
        postgresql_where=sa.text("session_id IS NOT NULL"),
    )

    op.create_table(
        "checkpoints",
        sa.Column("identity_id", sa.Text(), nullable=False),
        sa.Column("snapshot", sa.Text(), nullable=True),
        _timestamp("consolidated_at", nullable=True),
        sa.Column("runs", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "observations_consumed", sa.BigInteger(), server_default=sa.text("0"), nullable=False
        ),
        sa.PrimaryKeyConstraint("identity_id", name=op.f("pk_checkpoints")),
        schema=SCHEMA,
    )


def downgrade() -> None:
    # The schema stays: it holds Alembic's version table.
    for table in ("checkpoints", "fact_events", "facts", "observations"):
        op.drop_table(table, schema=SCHEMA)
