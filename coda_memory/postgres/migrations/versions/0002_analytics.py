"""Analytics: the usage rollup, fact indexes for aggregation, and the analytics views.

The rollup tables are backfilled from the observations already stored, so an upgrade
loses no history. The views read the rollup and the facts, never the raw observations;
``coda_memory.postgres.rollup`` describes the rollup and ``coda_memory.postgres.analytics``
the views.

Deploy order: upgrade, then run the new code. Observations that the old code commits
after the backfill's snapshot are stored but not rolled up.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement

from coda_memory.postgres.schema import migration_lock_timeout
from coda_memory.postgres.views import migrating_schema, view_statements

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every name below is translated to the configured schema by env.py.
SCHEMA = "coda_memory"

#: Created CONCURRENTLY: the facts table of a live database may be large and busy.
FACT_INDEXES = {
    "ix_facts_category_subject": ["category", "subject"],
    "ix_facts_category_identity_id": ["category", "identity_id"],
}
FACT_INDEX_INCLUDE = ["confidence", "confidence_at", "ease_factor"]

#: Views, in dependency order.
VIEWS = (
    "analytics_window",
    "active_facts",
    "tool_effectiveness",
    "entity_popularity",
    "domain_trends",
    "fact_summary",
)
TABLES = (
    "tool_daily",
    "tool_durations",
    "tool_users",
    "entity_daily",
    "entity_users",
    "domain_daily",
    "domain_users",
)

# The rollup's duration histogram (coda_memory.postgres.rollup): bucket 0 is below
# 1 ms, then 4 buckets per doubling, capped at 127.
BUCKETS_PER_DOUBLING = 4
MAX_BUCKET = 127
MAX_KEY_CHARS = 200


class _DropView(ExecutableDDLElement):
    """``DROP VIEW IF EXISTS name``."""

    inherit_cache = False

    def __init__(self, view: sa.Table) -> None:
        self.view = view


@compiles(_DropView)
def _compile_drop_view(element: _DropView, compiler: Any, **kw: Any) -> str:
    return f"DROP VIEW IF EXISTS {compiler.preparer.format_table(element.view)}"


def _timestamp(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def _observations(metadata: sa.MetaData) -> sa.Table:
    """The 0001 observations table, as far as the backfill reads it."""
    return sa.Table(
        "observations",
        metadata,
        sa.Column("identity_id", sa.Text()),
        sa.Column("type", sa.Text()),
        sa.Column("metadata", postgresql.JSONB()),
        _timestamp("created_at"),
        schema=SCHEMA,
    )


def _day(name: str = "day") -> sa.Column[Any]:
    return sa.Column(name, sa.Date(), nullable=False)


def _count(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.BigInteger(), nullable=False)


def _key(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.Text(), nullable=False)


def _shard() -> sa.Column[Any]:
    return sa.Column("shard", sa.SmallInteger(), nullable=False)


def _create_tables() -> dict[str, sa.Table]:
    # New and empty: their primary keys are built inside the transaction.
    def pk(name: str, *columns: str) -> sa.PrimaryKeyConstraint:
        return sa.PrimaryKeyConstraint(*columns, name=op.f(f"pk_{name}"))

    created = [
        op.create_table(
            "tool_daily",
            _day(),
            _key("tool_name"),
            _shard(),
            _count("successes"),
            _count("failures"),
            _count("latest_users"),
            pk("tool_daily", "day", "tool_name", "shard"),
            schema=SCHEMA,
        ),
        op.create_table(
            "tool_durations",
            _day(),
            _key("tool_name"),
            _shard(),
            sa.Column("bucket", sa.SmallInteger(), nullable=False),
            _count("calls"),
            pk("tool_durations", "day", "tool_name", "shard", "bucket"),
            schema=SCHEMA,
        ),
        op.create_table(
            "tool_users",
            _key("identity_id"),
            _key("tool_name"),
            _day("last_day"),
            sa.Column("previous_day", sa.Date(), nullable=True),
            pk("tool_users", "identity_id", "tool_name"),
            schema=SCHEMA,
        ),
        op.create_table(
            "entity_daily",
            _day(),
            _key("entity_type"),
            _key("entity_id"),
            _count("accesses"),
            _count("latest_users"),
            pk("entity_daily", "day", "entity_type", "entity_id"),
            schema=SCHEMA,
        ),
        op.create_table(
            "entity_users",
            _key("identity_id"),
            _key("entity_type"),
            _key("entity_id"),
            _day("last_day"),
            sa.Column("previous_day", sa.Date(), nullable=True),
            pk("entity_users", "identity_id", "entity_type", "entity_id"),
            schema=SCHEMA,
        ),
        op.create_table(
            "domain_daily",
            _day(),
            _key("domain"),
            _shard(),
            _count("queries"),
            _count("users"),
            pk("domain_daily", "day", "domain", "shard"),
            schema=SCHEMA,
        ),
        op.create_table(
            "domain_users",
            _key("identity_id"),
            _key("domain"),
            _day(),
            pk("domain_users", "identity_id", "domain", "day"),
            schema=SCHEMA,
        ),
    ]
    return {table.name: table for table in created}


# --- Backfill -------------------------------------------------------------------------


def _observed(
    observations: sa.Table, types: Sequence[str], extra: Sequence[Any] = (), **keys: Any
) -> Any:
    """Stored observations of ``types`` with usable keys, with their UTC day."""
    return (
        sa.select(
            observations.c.identity_id,
            observations.c.type,
            sa.cast(sa.func.timezone("UTC", observations.c.created_at), sa.Date).label("day"),
            *(value.label(name) for name, value in keys.items()),
            *extra,
        )
        .where(
            observations.c.type.in_(types),
            *(sa.func.length(value).between(1, MAX_KEY_CHARS) for value in keys.values()),
        )
        .subquery("observed")
    )


def _backfill_latest(observed: Any, users: sa.Table, daily: sa.Table, keys: list[str]) -> None:
    """Each identity's last day per key, then those identities counted on that day."""
    key_columns = [observed.c[k] for k in keys]
    op.execute(
        sa.insert(users).from_select(
            ["identity_id", *keys, "last_day"],
            sa.select(observed.c.identity_id, *key_columns, sa.func.max(observed.c.day)).group_by(
                observed.c.identity_id, *key_columns
            ),
        )
    )
    group = [users.c.last_day, *(users.c[k] for k in keys)]
    per_day = (
        sa.select(*group, sa.func.count().label("identities")).group_by(*group).subquery("per_day")
    )
    # Every last day is a day of use, so the backfilled daily row (shard 0) is there.
    op.execute(
        sa.update(daily)
        .values(latest_users=per_day.c.identities)
        .where(
            daily.c.day == per_day.c.last_day,
            *(daily.c[k] == per_day.c[k] for k in keys),
            *([daily.c.shard == 0] if "shard" in daily.c else []),
        )
    )


def _backfill(observations: sa.Table, tables: dict[str, sa.Table]) -> None:
    metadata = observations.c.metadata
    shard = sa.literal(0, sa.SmallInteger)

    # Tools: calls per day, the duration histogram, then the latest-day users.
    raw = metadata["durationMs"]
    # Clamped before the cast, so that no JSON number can fail it.
    clamped = sa.func.greatest(
        sa.func.least(sa.cast(raw, sa.Numeric), sa.literal(10**15, sa.BigInteger)), 0
    )
    duration = sa.case((sa.func.jsonb_typeof(raw) == "number", sa.cast(clamped, sa.Double)))
    doublings = sa.func.ln(duration) / math.log(2)
    # No ELSE: a missing duration has no bucket (least() would ignore the NULL).
    bucket = sa.cast(
        sa.case(
            (duration < 1, 0),
            (
                duration >= 1,
                sa.func.least(MAX_BUCKET, 1 + sa.func.floor(BUCKETS_PER_DOUBLING * doublings)),
            ),
        ),
        sa.SmallInteger,
    )
    tools = _observed(
        observations,
        ["tool_success", "tool_failure"],
        [bucket.label("bucket")],
        tool_name=metadata["toolName"].astext,
    )
    op.execute(
        sa.insert(tables["tool_daily"]).from_select(
            ["day", "tool_name", "shard", "successes", "failures", "latest_users"],
            sa.select(
                tools.c.day,
                tools.c.tool_name,
                shard,
                sa.func.count().filter(tools.c.type == "tool_success"),
                sa.func.count().filter(tools.c.type == "tool_failure"),
                sa.literal(0, sa.BigInteger),
            ).group_by(tools.c.day, tools.c.tool_name),
        )
    )
    op.execute(
        sa.insert(tables["tool_durations"]).from_select(
            ["day", "tool_name", "shard", "bucket", "calls"],
            sa.select(tools.c.day, tools.c.tool_name, shard, tools.c.bucket, sa.func.count())
            .where(tools.c.bucket.is_not(None))
            .group_by(tools.c.day, tools.c.tool_name, tools.c.bucket),
        )
    )
    _backfill_latest(tools, tables["tool_users"], tables["tool_daily"], ["tool_name"])

    # Entities: accesses per day, then the latest-day users.
    entities = _observed(
        observations,
        ["entity_access"],
        entity_type=metadata["entityType"].astext,
        entity_id=metadata["entityId"].astext,
    )
    keys = [entities.c.day, entities.c.entity_type, entities.c.entity_id]
    op.execute(
        sa.insert(tables["entity_daily"]).from_select(
            ["day", "entity_type", "entity_id", "accesses", "latest_users"],
            sa.select(*keys, sa.func.count(), sa.literal(0, sa.BigInteger)).group_by(*keys),
        )
    )
    _backfill_latest(
        entities, tables["entity_users"], tables["entity_daily"], ["entity_type", "entity_id"]
    )

    # Domains: the (identity, domain, day) rows, then queries and users per day.
    domains = _observed(observations, ["query_pattern"], domain=metadata["domain"].astext)
    users = tables["domain_users"]
    op.execute(
        sa.insert(users).from_select(
            ["identity_id", "domain", "day"],
            sa.select(domains.c.identity_id, domains.c.domain, domains.c.day).distinct(),
        )
    )
    per_day = (
        sa.select(users.c.day, users.c.domain, sa.func.count().label("users"))
        .group_by(users.c.day, users.c.domain)
        .subquery("per_day")
    )
    queries = (
        sa.select(domains.c.day, domains.c.domain, sa.func.count().label("queries"))
        .group_by(domains.c.day, domains.c.domain)
        .subquery("queries")
    )
    op.execute(
        sa.insert(tables["domain_daily"]).from_select(
            ["day", "domain", "shard", "queries", "users"],
            sa.select(
                queries.c.day, queries.c.domain, shard, queries.c.queries, per_day.c.users
            ).join_from(
                queries,
                per_day,
                sa.and_(per_day.c.day == queries.c.day, per_day.c.domain == queries.c.domain),
            ),
        )
    )


# --- Views ----------------------------------------------------------------------------


def _create_views() -> None:
    """Each view and its comment, from its file in ``migrations/views/0002``."""
    schema = migrating_schema(op.get_context())
    for name in VIEWS:
        for statement in view_statements(revision, name, schema):
            op.execute(sa.text(statement))


# --- Upgrade and downgrade ------------------------------------------------------------


def upgrade() -> None:
    # First, outside any transaction: CONCURRENTLY keeps the facts table writable while
    # the indexes build. An interrupted build leaves an invalid index behind, so one of
    # the same name is dropped first. Nothing of this revision is committed before. Each
    # statement is a transaction of its own: the lock timeout is the session's meanwhile
    # (a build waits for every transaction that writes the table; without it, an idle
    # one would hold the migration for ever).
    with op.get_context().autocommit_block():
        op.execute(migration_lock_timeout(session=True))
        try:
            for name, columns in FACT_INDEXES.items():
                op.drop_index(
                    name, "facts", schema=SCHEMA, postgresql_concurrently=True, if_exists=True
                )
                op.create_index(
                    name,
                    "facts",
                    columns,
                    schema=SCHEMA,
                    postgresql_include=FACT_INDEX_INCLUDE,
                    postgresql_concurrently=True,
                )
        finally:
            op.execute(sa.text("RESET lock_timeout"))
    # The transaction that began after the block has none of the environment's settings.
    op.execute(migration_lock_timeout())
    # Then, in one transaction with the version bump: the rollup, its backfill, the views.
    tables = _create_tables()
    _backfill(_observations(sa.MetaData()), tables)
    _create_views()


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute(migration_lock_timeout(session=True))
        try:
            for name in FACT_INDEXES:
                op.drop_index(
                    name, "facts", schema=SCHEMA, postgresql_concurrently=True, if_exists=True
                )
        finally:
            op.execute(sa.text("RESET lock_timeout"))
    op.execute(migration_lock_timeout())
    metadata = sa.MetaData()
    for name in reversed(VIEWS):
        op.execute(_DropView(sa.Table(name, metadata, schema=SCHEMA)))
    for name in TABLES:
        op.drop_table(name, schema=SCHEMA)
